"""Running `lockstep` in-process for the CLI tests."""

from __future__ import annotations

from launcher.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `lockstep ARGV` in-process: (exit code, stdout, stderr); argparse exits count too."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
