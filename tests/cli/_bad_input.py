"""What the bad-input tests share: the one-line, exit-2 assertion (their fixture ``no_training`` is in conftest)."""

from trainguard.cli.main import main


def one_line_exit_2(capsys, argv, needle: str = "") -> str:
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors end the process the same way: one line, code 2
        rc = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (argv, rc, err[-2000:])
    assert "Traceback" not in err, (argv, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: "), (argv, err[-2000:])
    assert needle in lines[0], (argv, needle, lines[0])
    return lines[0]
