"""Reading JSONL inputs of the operator tools, with errors that name the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError


def iter_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line, read as they come (a log larger
    than memory streams through). Raises ConfigError for an unreadable file, a line that
    is not JSON, or one that is not an object."""
    try:
        lines = path.open()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    with lines:
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{i}: not a JSON object")
            yield i, row
