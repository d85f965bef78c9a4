"""One log record, one line: control characters in a record's message (a request id, a
model name, an error a client caused) are escaped before any handler writes it, so
that no value can forge a line in the text log or reach a terminal as an escape
sequence. `hotprefix serve` and `hotprefix gateway` install it on their handlers once
uvicorn has set up its own (a traceback after the message keeps its lines)."""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """`text` with every control character (C0, DEL, C1, line and paragraph separators)
    written as an escape: \\n, \\r, \\t, \\x1b, \\u2028."""
    def one(m: re.Match[str]) -> str:
        c = m.group()
        return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")

    return _CONTROL.sub(one, text)


class EscapeControls(logging.Filter):
    """A handler filter: the record's message, formatted, with its control characters
    escaped (it mutates the record: every handler then writes the escaped message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = escape_controls(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


def escape_log_lines(loggers: tuple[str, ...] = ("", "uvicorn")) -> None:
    """Install EscapeControls on the handlers of `loggers` (root and uvicorn's; not
    uvicorn.access, whose formatter reads the record's arguments and whose line holds
    only what the HTTP parser accepted). Idempotent."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, EscapeControls) for f in handler.filters):
                handler.addFilter(EscapeControls())
