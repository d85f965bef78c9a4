"""The grammar compiler's worker process: `python -m hotprefix.grammar_worker CONN SETUP`,
started by grammar_sandbox.py.

It is started by its own command line, not by multiprocessing's "spawn", which runs the
parent's main module again in the child: a user's script without an
`if __name__ == "__main__":` guard built a second LLM there, and the first waited for
its worker forever. This module imports only the torch-free compiler (grammar_build.py).
CONN is the file descriptor of its end of a socket pair to the parent; SETUP one of a
file holding the pickled (SandboxConfig, tokenizer JSON). It sends ("ready", "") once it
can compile, or ("error", why) and exits 1 when it cannot start; then answers each
(kind, spec) with ("ok", grammar) or ("err", why) until None or the parent's end closes.
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any

from hotprefix.errors import InvalidRequestError
from hotprefix.grammar_build import build
from hotprefix.sampling_params import StructuredKind


def _start(setup_fd: int) -> tuple[Any, Any]:
    """The worker's config and llguidance tokenizer, read from the setup file (closed);
    its address space capped at cfg.max_memory first. Raises what fails."""
    with os.fdopen(setup_fd, "rb") as f:
        cfg, tokenizer_json = pickle.load(f)
    if cfg.max_memory:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (cfg.max_memory, cfg.max_memory))
    import llguidance

    return cfg, llguidance.LLTokenizer(tokenizer_json, n_vocab=cfg.vocab_size, eos_token=list(cfg.eos) or None)


def _serve(conn: Connection, cfg: Any, tok: Any) -> None:
    """Answer the parent's specs until it says None or goes away (its exit closes its end:
    nothing to report)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, spec = msg
        try:
            compiled = build(StructuredKind(kind), spec, tok, cfg.vocab_size)
            answer = ("ok", compiled.grammar) if compiled.error is None else ("err", compiled.error)
        except InvalidRequestError as e:
            answer = ("err", str(e))
        except MemoryError:
            answer = ("err", "compiling it needed more memory than the compiler may use")
        try:
            conn.send(answer)
        except OSError:  # the parent went away while it compiled
            return


def main(argv: list[str]) -> int:
    """The worker's life; its exit status (1: it could not start, and said why)."""
    conn = Connection(int(argv[1]))
    try:
        cfg, tok = _start(int(argv[2]))
    except BaseException as e:  # noqa: BLE001 - any failure to start is reported to the parent, then exits
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    try:
        conn.send(("ready", ""))
    except OSError:
        return 0
    _serve(conn, cfg, tok)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
