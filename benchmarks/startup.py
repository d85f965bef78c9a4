"""Start to /health: hotprefix serve (one or more checkouts) and llama-server on the
same GGUF file, runs interleaved, from launching the command to the first 200 from
/health (polled every 20 ms), the server then stopped (SIGTERM to its process group).
Each start also records the CPU time its process used until then (user + system, all
threads): on a machine shared with other work, the part of a start that is its own.

  warm   a file this checkout has started before: kernels built, int8 weights regrouped
         into its cache, the file in the page cache, the checkout's bytecode cache written
  first  a new file to hotprefix: each run a fresh copy of the file (a new path, size
         and time: model/weight_cache.py and the tokenizer cache key by them), removed after

Each checkout (--checkout NAME=DIR, run with PYTHONPATH=DIR; default: this one) has its own
$HOTPREFIX_CACHE under --cache, so that two checkouts' regrouped weights (named by their
kernel sources) do not replace each other.

    .venv/bin/python benchmarks/startup.py --model FILE.gguf [--checkout base=DIR --checkout new=.]
        [--runs 5] [--first 3] [--llama-server PATH/llama-server] [--cache DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from run_facts import report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, all its threads and waited children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def start_to_health(cmd: list[str], port: int, env: dict | None = None, timeout: float = 600.0,
                    cwd: str | None = None) -> tuple[float, float]:
    """Seconds from launching cmd to a 200 from its /health, and the CPU seconds it used
    until then; the server is then stopped. Raises RuntimeError when it exits or does not
    answer within `timeout`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env, cwd=(env or {}).get("PYTHONPATH", cwd))
    try:
        while time.perf_counter() - t0 < timeout:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0, cpu_seconds(proc.pid)
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError(f"{cmd[0]}: no /health within {timeout}s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def hotprefix_cmd(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "hotprefix", "serve", "--model", model, "--port", str(port)]


def llama_cmd(binary: str, model: str, port: int) -> list[str]:
    return [binary, "-m", model, "--port", str(port), "--no-repack", "-t", str(len(os.sched_getaffinity(0)))]


def checkout_env(folder: Path, cache: Path) -> dict:
    """The environment of a checkout's server: its sources first on the path (the server
    also runs in that folder: `python -m` puts the working directory before PYTHONPATH),
    its own cache, and Python's bytecode cache written (the first start writes it, as an
    installed package has it): without, as where PYTHONDONTWRITEBYTECODE is set, every
    start compiled hotprefix's ~115 modules again (~0.25 s CPU)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(folder.resolve()), "HOTPREFIX_CACHE": str(cache)}


def drop_regrouped(path: Path, cache: Path) -> None:
    """Remove the regrouped weights of `path` from a cache (weight_cache.cache_path's names)."""
    who = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    for f in (cache / "regrouped").glob(f"{who}-*"):
        f.unlink(missing_ok=True)


def summary(runs: list[tuple[float, float]]) -> dict:
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    return {"median_s": round(statistics.median(walls), 3), "median_cpu_s": round(statistics.median(cpus), 3),
            "runs_s": [round(t, 3) for t in walls], "runs_cpu_s": [round(t, 3) for t in cpus]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--runs", type=int, default=5, help="warm starts of each server")
    ap.add_argument("--first", type=int, default=0, help="first starts of a new file (hotprefix)")
    ap.add_argument("--llama-server", help="the llama-server binary (run with --no-repack)")
    ap.add_argument("--cache", default="/tmp/hotprefix-startup-cache", help="the checkouts' caches go under it")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = Path(a.model).resolve()
    checkouts = dict(c.split("=", 1) for c in a.checkout) or {"this": "."}
    envs = {name: checkout_env(Path(d), Path(a.cache) / name) for name, d in checkouts.items()}
    runs: dict[str, list[tuple[float, float]]] = {}
    port = free_port()
    for env in envs.values():  # the file known, the kernels built, the tokenizer converted
        start_to_health(hotprefix_cmd(str(model), port), port, env)
    with tempfile.TemporaryDirectory(dir=model.parent) as tmp:
        for i in range(max(a.runs, a.first)):
            for name, env in envs.items():
                if i < a.runs:
                    runs.setdefault(f"{name}_warm", []).append(
                        start_to_health(hotprefix_cmd(str(model), port), port, env))
                if i < a.first:
                    path = Path(tmp) / f"new-{i}-{name}-{model.name}"
                    shutil.copyfile(model, path)
                    try:
                        runs.setdefault(f"{name}_first", []).append(
                            start_to_health(hotprefix_cmd(str(path), port), port, env))
                    finally:
                        drop_regrouped(path, Path(env["HOTPREFIX_CACHE"]))
                        path.unlink()
            if a.llama_server and i < a.runs:
                runs.setdefault("llama_server", []).append(
                    start_to_health(llama_cmd(a.llama_server, str(model), port), port))
    report({"model": str(model), "checkouts": checkouts, "load_avg": os.getloadavg(),
            **{k: summary(v) for k, v in runs.items()}}, a.json)


if __name__ == "__main__":
    main()
