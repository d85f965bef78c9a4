"""Compiling output constraints where the work can be stopped: worker processes.

llguidance compiles a JSON schema, regex or grammar in native code that no Python
thread can interrupt, and a hostile spec (a schema of 15,000 properties, a regex of
nested repetitions) kept a preprocessing thread for a minute after its request had
been answered, starving every other tenant. So a spec is first compiled, and its first
token mask built, in a worker process (spawned, so it imports neither torch nor
transformers; about 0.5 s to start, with the model's tokenizer given as its JSON, made for
each start and never kept: 11 MiB at a 262,144-token vocabulary). A
worker that spends more CPU time on one spec than the budget (--max-grammar-compile-seconds,
measured from /proc; four times as long in wall-clock time on a machine too loaded to
say) is killed and replaced, and the request gets a 400; one that runs out of its
address space (max_memory) dies and the request gets a 400 too. A spec the worker
compiled within its budget is then compiled again in the server's own process
(grammar.py), which therefore takes about as long. Both compile with grammar_build.build.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotprefix.errors import InvalidRequestError
from hotprefix.grammar_build import build
from hotprefix.sampling_params import StructuredKind

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker's start-up (interpreter, llguidance, the tokenizer), on a loaded machine


@dataclass(frozen=True)
class SandboxConfig:
    """vocab_size: the model's logits; eos: its end-of-sequence ids; budget_s: CPU seconds
    one spec may take; workers: at most this many processes; max_memory: each one's
    address space in bytes (0: no cap)."""

    vocab_size: int
    eos: tuple[int, ...]
    budget_s: float = 5.0
    workers: int = 2
    max_memory: int = 4 << 30


def _worker_main(conn: Any, cfg: SandboxConfig, tokenizer_json: str) -> None:  # in the worker process
    if cfg.max_memory:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (cfg.max_memory, cfg.max_memory))
    import llguidance

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=cfg.vocab_size, eos_token=list(cfg.eos) or None)
    conn.send(("ready", ""))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away without saying so (it exited): nothing to report
            return
        if msg is None:
            return
        kind, spec = msg
        try:
            compiled = build(StructuredKind(kind), spec, tok, cfg.vocab_size)
            conn.send(("ok", compiled.grammar) if compiled.error is None else ("err", compiled.error))
        except InvalidRequestError as e:
            conn.send(("err", str(e)))
        except MemoryError:
            conn.send(("err", "compiling it needed more memory than the compiler may use"))


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, cfg: SandboxConfig, tokenizer_json: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, cfg, tokenizer_json), daemon=True,
                                name="hotprefix-grammar")
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        """Raises RuntimeError when the worker does not come up."""
        if not self.ready:
            if not self.conn.poll(START_TIMEOUT_S):
                raise RuntimeError("the grammar compiler process did not start")
            self.conn.recv()
            self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class CompileSandbox:
    """Thread-safe: each call takes a free worker (starting one while fewer than
    cfg.workers exist, else waiting for one). `tokenizer_json` gives the model's tokenizer
    as tokenizers' JSON, called at each worker's start (the text is not kept)."""

    def __init__(self, cfg: SandboxConfig, tokenizer_json: Callable[[], str]) -> None:
        self.cfg = cfg
        self.tokenizer_json = tokenizer_json
        self._ctx = mp.get_context("spawn")
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._count = 0
        self.killed = 0  # workers killed over their budget or memory (tests, logs)

    def grammar(self, kind: StructuredKind, spec: str) -> str:
        """The llguidance grammar of a spec that compiles (with its first mask) within the
        budget. Raises InvalidRequestError: the spec's own error, or that it took too long
        or too much memory to compile."""
        w = self._take()
        try:
            w.wait_ready()
            w.conn.send((kind.value, spec))
            status, text = self._answer(w, kind)
        except BaseException:
            self._discard(w)
            raise
        self._idle.put(w)
        if status == "err":
            raise InvalidRequestError(text, kind.value)
        return text

    def _answer(self, w: _Worker, kind: StructuredKind) -> tuple[str, str]:
        """The worker's answer, or InvalidRequestError once it is over its budget."""
        cpu0, t0 = _cpu_seconds(w.proc.pid), time.monotonic()
        budget = self.cfg.budget_s
        while not w.conn.poll(0.02):
            cpu, wall = _cpu_seconds(w.proc.pid), time.monotonic() - t0
            over_cpu = cpu is not None and cpu0 is not None and cpu - cpu0 > budget
            if over_cpu or wall > 4 * budget + 1 or not w.proc.is_alive():
                break
        else:
            try:
                return w.conn.recv()
            except EOFError:  # it died answering: its address space ran out
                pass
        why = ("exhausted the compiler's memory" if not w.proc.is_alive()
               else f"took more than {budget:g}s of CPU time to compile")
        raise InvalidRequestError(f"the {kind.value} constraint {why} (--max-grammar-compile-seconds); "
                                  "send a simpler one", kind.value)

    def _take(self) -> _Worker:
        """An idle worker, or a new one while fewer than cfg.workers exist (a killed one
        frees its place: waiters look again every 50 ms)."""
        while True:
            try:
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                pass
            with self._lock:
                start = self._count < self.cfg.workers
                self._count += start
            if start:
                return _Worker(self._ctx, self.cfg, self.tokenizer_json())

    def _discard(self, w: _Worker) -> None:
        """A worker over its budget (or broken): killed; the next call starts another."""
        w.kill()
        self.killed += 1
        with self._lock:
            self._count -= 1
        log.warning("killed a grammar compiler process that went over its budget")

    def close(self) -> None:
        """Stop the idle workers (a busy one finishes its spec first); a later call
        starts new ones."""
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                return
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.proc.join(2)
            w.kill()
            with self._lock:
                self._count -= 1
