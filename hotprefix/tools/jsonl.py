"""Reading JSONL inputs of the operator tools, line by line, each line bounded, with
errors that are one line naming the line; and JSON as the tools print it (json_text).

A line is read with at most `max_line_bytes` held (a longer one is an error, not a
read), and checked as the server's edge checks a body (server/body_guard): UTF-8,
JSON, one object, no deeper than 64 levels, no integer of more than 4,300 digits, no
NaN or Infinity, no lone surrogate. More than `max_rows` rows is an error too: the
tools keep what they read. A last line without its newline that is not JSON is skipped
with a warning: a writer killed mid-line (or still writing it) left it, and the server's
request log cuts such a line when it starts again (request_log.open_for_append)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.server.body_guard import BodyRejected, parse_json_object
from hotprefix.server.log_lines import escape_controls

log = logging.getLogger("hotprefix.tools")

MAX_LINE_BYTES = 4 << 20  # as the server's default --max-request-body-bytes
MAX_ROWS = 100_000


def _where(path: Path, line: int) -> str:
    return f"{escape_controls(str(path))}:{line}"


def iter_objects(path: Path, max_line_bytes: int = MAX_LINE_BYTES,
                 max_rows: int | None = MAX_ROWS) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line. Raises ConfigError for an
    unreadable file, a line longer than max_line_bytes, one that is not a JSON object
    (see the module doc), or more than max_rows rows (None: no limit)."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise ConfigError(f"cannot read {escape_controls(str(path))}: {e.strerror}") from None
    rows = 0
    with f:
        for i, line in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), 1):
            if len(line) > max_line_bytes:
                raise ConfigError(f"{_where(path, i)}: a line longer than {max_line_bytes} bytes "
                                  "(--max-line-bytes)")
            if not line.strip():
                continue
            rows += 1
            if max_rows is not None and rows > max_rows:
                raise ConfigError(f"{_where(path, i)}: more than {max_rows} rows (--max-rows)")
            try:
                row = parse_json_object(line)
            except BodyRejected as e:
                if not line.endswith(b"\n"):  # the last line (readline stops at a newline or the end)
                    log.warning("%s: an unfinished last line (no newline; %s) skipped: its writer was killed or "
                                "is still writing it", _where(path, i), escape_controls(str(e)))
                    return
                raise ConfigError(f"{_where(path, i)}: {escape_controls(str(e))}") from None
            yield i, row


_UNPRINTED = re.compile("[\x7f-\x9f\u2028\u2029]")


def json_text(obj: Any) -> str:
    """Indented JSON as printed: non-ASCII text kept, every control character escaped (JSON
    escapes C0 itself; DEL, C1 and the line separators here), so none reaches a terminal."""
    return _UNPRINTED.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, indent=2, ensure_ascii=False))
