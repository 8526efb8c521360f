from trainguard.cli.main import main
from trainguard.train.launch import exit_rank, skip_finalization

code = main()
if skip_finalization():  # a rank, or an elastic replica: leave without torch's gloo teardown (see exit_rank)
    exit_rank(code)
raise SystemExit(code)
