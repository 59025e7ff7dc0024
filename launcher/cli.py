"""The `lockstep` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lockstep", description="Lockstep MoE serving runtime")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "make-model",
        help="write a tiny random Hugging Face-format MoE checkpoint",
        add_help=False,  # the subcommand parses (and documents) its own options
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "make-model":
        from dist_engine.make_model import main as make_model_main

        return make_model_main(rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
