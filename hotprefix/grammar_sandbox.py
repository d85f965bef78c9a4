"""Compiling output constraints where the work can be stopped: worker processes.

llguidance compiles a JSON schema, regex or grammar in native code that no Python
thread can interrupt, and a hostile spec (a schema of 15,000 properties, a regex of
nested repetitions) kept a preprocessing thread for a minute after its request had
been answered, starving every other tenant. So a spec is first compiled, and its first
token mask built, in a worker process (`python -m hotprefix.grammar_worker`: it imports
neither torch, nor transformers, nor the parent's main module; about 0.5 s to start, with
the model's tokenizer given as its JSON, made for each start and never kept: 11 MiB at a
262,144-token vocabulary). A worker that fails to start is an error at once. A
worker that spends more CPU time on one spec than the budget (--max-grammar-compile-seconds,
measured from /proc; four times as long in wall-clock time on a machine too loaded to
say) is killed and replaced, and the request gets a 400; one that runs out of its
address space (max_memory) dies and the request gets a 400 too. A spec the worker
compiled within its budget is then compiled again in the server's own process
(grammar.py), which therefore takes about as long. Both compile with grammar_build.build.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hotprefix.errors import InvalidRequestError
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


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class _Worker:
    """One worker process (grammar_worker.py) and the parent's end of its socket pair. The
    config and tokenizer JSON go in an unlinked file the worker reads, so starting never
    waits on the worker; a worker still running at the parent's exit is killed."""

    def __init__(self, cfg: SandboxConfig, tokenizer_json: str) -> None:
        parent, child = socket.socketpair()
        with child, tempfile.TemporaryFile() as setup:
            pickle.dump((cfg, tokenizer_json), setup)
            setup.flush()
            setup.seek(0)
            fds = (child.fileno(), setup.fileno())
            self.proc = subprocess.Popen([sys.executable, "-m", "hotprefix.grammar_worker", *map(str, fds)],
                                         pass_fds=fds, stdin=subprocess.DEVNULL, env=_worker_env())
        self.conn = Connection(parent.detach())
        self.ready = False
        _LIVE.add(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self) -> None:
        """Until the worker says it can compile. Raises RuntimeError saying why when it
        reports a failure to start, exits, or is silent for START_TIMEOUT_S."""
        if self.ready:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.conn.poll(0.05):
            if not self.alive() or time.monotonic() > deadline:
                break
        else:
            try:
                status, text = self.conn.recv()
            except EOFError:  # it exited
                status, text = "exited", ""
            if status == "ready":
                self.ready = True
                return
            if status == "error":
                raise RuntimeError(f"the grammar compiler process did not start: {text}")
        try:
            code = self.proc.wait(5)
            why = f"it exited with status {code}" if code >= 0 else f"it was killed by signal {-code}"
        except subprocess.TimeoutExpired:
            why = f"it said nothing for {START_TIMEOUT_S:g}s"
        raise RuntimeError(f"the grammar compiler process did not start: {why}")

    def wait(self, seconds: float) -> None:
        """Until the process exits, for at most `seconds`."""
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.proc.kill()
        self.wait(5)
        self.conn.close()


_LIVE: weakref.WeakSet[_Worker] = weakref.WeakSet()  # killed at exit, as multiprocessing's daemons were


@atexit.register
def _kill_live() -> None:
    for w in list(_LIVE):
        if w.alive():
            w.proc.kill()


def _worker_env() -> dict[str, str]:
    """The environment with PYTHONPATH the parent's sys.path, in its order: the worker
    imports what its parent would (this hotprefix, wherever it came from), as
    multiprocessing's spawn gave its children the parent's sys.path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    return env


class CompileSandbox:
    """Thread-safe: each call takes a free worker (starting one while fewer than
    cfg.workers exist, else waiting for one). `tokenizer_json` gives the model's tokenizer
    as tokenizers' JSON, called at each worker's start (the text is not kept)."""

    def __init__(self, cfg: SandboxConfig, tokenizer_json: Callable[[], str]) -> None:
        self.cfg = cfg
        self.tokenizer_json = tokenizer_json
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
            if over_cpu or wall > 4 * budget + 1 or not w.alive():
                break
        else:
            try:
                return w.conn.recv()
            except EOFError:  # it died answering: its address space ran out
                pass
        why = ("exhausted the compiler's memory" if not w.alive()
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
                try:
                    return _Worker(self.cfg, self.tokenizer_json())
                except BaseException:  # (no process to wait for: its place is free again)
                    with self._lock:
                        self._count -= 1
                    raise

    def _discard(self, w: _Worker) -> None:
        """A worker over its budget (or broken): killed; the next call starts another."""
        w.kill()
        self.killed += 1
        with self._lock:
            self._count -= 1
        log.warning("stopped a grammar compiler process (over its budget, or broken)")

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
            w.wait(2)
            w.kill()
            with self._lock:
                self._count -= 1
