"""The `--help` of `hotprefix serve` and `hotprefix generate` in the docs, generated from
the flag declarations: `python scripts/cli_docs.py` rewrites each block between its
markers (`make docs`); `--check` only says which are out of date (exit 1), as the test
does (tests/unit/test_flags.py). A block is the parser's own --help, 78 columns wide.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (run as a script from a checkout)
BLOCKS = {"generate": ROOT / "docs" / "cli.md", "serve": ROOT / "docs" / "server.md"}
BEGIN = "<!-- BEGIN `hotprefix {} --help`: generated from the flag declarations by `make docs` -->\n"
END = "<!-- END `hotprefix {} --help` -->\n"
WIDTH = 78


def help_text(command: str) -> str:
    """`hotprefix COMMAND --help` as printed at WIDTH columns, whatever the terminal."""
    from hotprefix.cli import build_parser, subparser

    sub = subparser(build_parser(), command)
    sub.formatter_class = functools.partial(argparse.HelpFormatter, width=WIDTH)
    return sub.format_help()


def rendered(text: str, command: str) -> str:
    """text with the block of COMMAND's --help between its markers replaced by the current
    one. Raises ValueError when text has no such markers."""
    begin, end = BEGIN.format(command), END.format(command)
    if begin not in text or end not in text:
        raise ValueError(f"no markers {begin.strip()} ... {end.strip()}")
    head, rest = text.split(begin, 1)
    return head + begin + "```\n" + help_text(command) + "```\n" + end + rest.split(end, 1)[1]


def stale() -> list[str]:
    """The docs whose --help block differs from the declarations (none: all current)."""
    return [str(path.relative_to(ROOT)) for command, path in BLOCKS.items()
            if rendered(path.read_text(), command) != path.read_text()]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        out = stale()
        for path in out:
            print(f"{path}: its --help block is out of date; run `make docs`", file=sys.stderr)
        return 1 if out else 0
    for command, path in BLOCKS.items():
        path.write_text(rendered(path.read_text(), command))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
