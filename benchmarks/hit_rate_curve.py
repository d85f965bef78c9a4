"""What the hit-rate curve (`hotprefix lint LOG --curve`) costs and how close it is.

    .venv/bin/python benchmarks/hit_rate_curve.py synthetic ROWS [--no-full-replays] [--out FILE]
        A request log of ROWS chat requests (seeded: 300 conversations at a time over 6
        system prompts of 20-60 blocks, 3 tenants, 1-6 new blocks a turn, conversations
        restart past 180 blocks), written as the server writes it; then, in this process,
        CPU seconds and peak RSS of reading it and of the one pass, the curve against
        replays of the engine's policy at 6 sizes (all requests) and against the engine
        itself (tools/cache_sim.py) at 2 sizes (the first 5,000 requests); and
        `hotprefix lint LOG --curve` as a command: its CPU seconds, wall time and RSS.
        --no-full-replays leaves out the replays over all requests (a million rows: the
        time and memory of the curve itself; the 5,000-request checks stay).
    .venv/bin/python benchmarks/hit_rate_curve.py servers [--out FILE]
        The lint logs (support bot, RAG, chats, interleaved) sent to real servers of a
        tiny model (block size 16): the curve of the captured log at three pool sizes and
        with a host tier, against what each server measures; the recommendation applied.

Prints one JSON line (with the run's date, commit, machine and CPU flags).
"""

from __future__ import annotations

import hashlib
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_facts import report

from hotprefix.cachecurve.curve import CHECK_REQUESTS, Options, build
from hotprefix.cachecurve.policy_sim import PolicySim
from hotprefix.cachecurve.request import SimRequest
from hotprefix.server.request_log import KVShape, LogRow, LogStatus, PrefixEntry
from hotprefix.tools.cache_sim import CacheSize, replay
from hotprefix.tools.curve_log import read_log


def write_synthetic(path: Path, rows: int, bs: int = 16, seed: int = 0) -> None:
    rng = random.Random(seed)
    systems = [rng.randint(20, 60) for _ in range(6)]
    convs: dict[int, list] = {}
    kv = KVShape(bs, 2000, 0, 36_864)

    def digest(*parts: object) -> str:
        return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()

    with path.open("w") as f:
        for i in range(rows):
            c = rng.randrange(300)
            if c not in convs or len(convs[c]) > 180:
                s = rng.randrange(len(systems))
                convs[c] = [("s", s, j) for j in range(systems[s])]
            convs[c] += [("u", c, i, j) for j in range(rng.randint(1, 6))]
            salt, chain, h = f"tenant{c % 3}", [], f"tenant{c % 3}"
            for part in convs[c] + [("o", i, j) for j in range(4)]:
                h = digest(h, part)
                chain.append(h)
            p, out = len(convs[c]) * bs - rng.randrange(bs), rng.randint(1, 40)
            entry = PrefixEntry(p, 0, out, tuple(chain[:(p + out) // bs]), digest("salt", salt))
            t = 1.8e9 + i
            f.write(json.dumps(LogRow(t + 0.5, f"r{i}", "/v1/chat/completions", "m", None, LogStatus.OK, p, 0, out,
                                      0.1, 0.5, "stop", kv, (entry,)).to_json()) + "\n")


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def synthetic(rows: int, full_replays: bool = True) -> dict:
    out: dict = {"rows": rows}
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "requests.jsonl"
        write_synthetic(log, rows)
        out["file_mib"] = round(log.stat().st_size / 2**20, 1)
        t = cpu()
        traffic = read_log(log, max_rows=rows)
        out["read_cpu_s"], t = round(cpu() - t, 2), cpu()
        out["blocks"] = sum(len(r.hashes) for r in traffic.reqs)
        curve = build(traffic.reqs, traffic.tenants, 16, traffic.span_s, Options(checks=0))
        out["pass_cpu_s"] = round(cpu() - t, 2)
        out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        out["sample_rate"], out["sample_error_points"] = curve.sample_rate, curve.sample_error
        out["unbounded"] = round(100 * curve.unbounded, 2)
        if full_replays:
            out["vs_policy_replays"] = _policy(curve, traffic.reqs)
        out["vs_engine_replays"] = _engine(traffic.reqs[:CHECK_REQUESTS])
        del traffic, curve  # the command below reads the log again, in its own process
        t0, c0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", str(log), "--curve", "--max-rows", str(rows)],
                       check=True,
                       stdout=subprocess.DEVNULL)
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out["cli"] = {"cpu_s": round(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, 1),
                      "wall_s": round(time.monotonic() - t0, 1), "rss_mib": c1.ru_maxrss // 1024}
    return out


def _policy(curve, reqs: list[SimRequest]) -> list[dict]:
    """The curve against the policy replayed over every request, at 6 sizes up to 95 %."""
    top = curve.pool_for(0.95)
    rows = []
    for n in sorted({max(curve.largest, top * k // 6) for k in range(1, 7)}):
        sim = PolicySim(n, 0, 16)
        got = sum(sim.run(r) or 0 for r in reqs) / curve.prompt_tokens
        rows.append({"blocks": n, "curve": round(100 * curve.rate(n), 3), "replay": round(100 * got, 3)})
    return rows


def _engine(reqs: list[SimRequest]) -> list[dict]:
    """The pass over the first requests against the engine's own replay (tools/cache_sim.py)."""
    keyed = [SimRequest([bytes.fromhex(h) for h in r.hashes], r.prompt_tokens, r.output_tokens) for r in reqs]
    curve = build(keyed, [None] * len(keyed), 16, None, Options(checks=0))
    tokens = sum(r.prompt_tokens for r in keyed)
    return [{"blocks": n, "curve": round(100 * curve.rate(n), 3),
             "engine": round(100 * replay(keyed, 16, CacheSize(n)).total_hits / tokens, 3)}
            for n in (curve.pool_for(0.5), curve.pool_for(0.95))]


def servers() -> dict:
    """The real-server comparisons of tests/tools/test_curve_server.py, with their numbers."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hotprefix.cachecurve.advice import advise
    from hotprefix.config import parse_size
    from tests.conftest import build_tiny_model
    from tests.tools import test_curve_server as t

    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "tiny"
        model.mkdir()
        build_tiny_model(model, "llama", max_position_embeddings=1024)
        unbounded, _ = t.serve(model, Path(d) / "capture.jsonl")
        traffic = read_log(Path(d) / "capture.jsonl")
        curve = build(traffic.reqs, traffic.tenants, 16, traffic.span_s, Options(checks=0))
        out: dict = {"requests": curve.requests,
                     "unbounded": [round(100 * curve.unbounded, 2), round(100 * unbounded, 2)]}
        p95 = curve.pool_for(0.95)
        sizes = sorted({curve.largest + 2, (curve.largest + p95) // 2, p95})
        out["pools"] = [[n, round(100 * curve.rate(n), 2), round(100 * t.serve(model, Path(d) / f"{n}.jsonl",
                                                                                num_blocks_override=n)[0], 2)]
                        for n in sizes]
        host = build(traffic.reqs, traffic.tenants, 16, None, Options(host_blocks=p95, pools=(sizes[0],), checks=0))
        measured, _ = t.serve(model, Path(d) / "host.jsonl", num_blocks_override=sizes[0],
                              kv_offloading_size=p95 * traffic.kv.block_bytes)
        out["host"] = [sizes[0], p95, round(100 * host.host_rate(sizes[0]), 2), round(100 * measured, 2)]
        a = advise(curve, traffic.kv.block_bytes, None)
        measured, _ = t.serve(model, Path(d) / "rec.jsonl", num_blocks_override=None,
                              kv_cache_memory=parse_size(a.recommended.flag))
        out["recommended"] = [a.recommended.flag, a.recommended.blocks, round(100 * a.recommended_rate, 2),
                              round(100 * measured, 2)]
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    dest = args[args.index("--out") + 1] if "--out" in args else None
    result = synthetic(int(args[1]), "--no-full-replays" not in args) if args[0] == "synthetic" else servers()
    report({"benchmark": f"hit_rate_curve {' '.join(args)}", **result}, dest)
