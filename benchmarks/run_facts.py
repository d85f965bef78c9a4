"""What every benchmark result records about its run: date, commit, machine, CPU flags.

    from run_facts import report      # in a script of benchmarks/ (its folder is on sys.path)
    report(result, path)              # prints result + the facts as JSON; writes them to path if given

    .venv/bin/python benchmarks/run_facts.py COMMAND...   # the facts alone, with the command (run_all.sh's meta.json)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

from hotprefix.model.kernels.build import cpu_vector_flags


def facts() -> dict[str, Any]:
    """Date (UTC, to the minute), short commit, machine and the CPU's vector flags."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, {platform.processor() or 'cpu'}",
            "cpu_flags": cpu_vector_flags()}


def report(result: dict[str, Any], path: str | None = None) -> None:
    """Print result with the run's facts as JSON, and write the same to path if given."""
    text = json.dumps({**result, **facts()}, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    print(json.dumps({**facts(), "command": " ".join(sys.argv[1:])}))
