from trainguard.cli.main import main
from trainguard.train.launch import exit_rank, under_launcher

code = main()
if under_launcher():  # a rank of a multi-process run: leave without torch's gloo teardown (see exit_rank)
    exit_rank(code)
raise SystemExit(code)
