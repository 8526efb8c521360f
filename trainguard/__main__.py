from trainguard.cli.main import main

raise SystemExit(main())
