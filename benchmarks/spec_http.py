"""Decode speed with and without speculation over HTTP, hotprefix against llama-server's
`--spec-type` modes (issue 45's goal: on quote, edit and json, decode tokens/s with
speculation >= llama-server with its best spec type on the same prompts).

The workloads are speculative.py's (spec_prompts.py: quote, edit, json, unique, chat), sent as
chat messages to /v1/chat/completions (each server applies the model's chat template),
streamed, greedy (temperature 0), `max_tokens` 96; `ignore_eos` on all but json, whose
`response_format` is the json_schema (hotprefix refuses ignore_eos under a structured
output: its end is EOS). Per request: decode tokens/s (the completion tokens after the
first over the time from the first streamed token to the last), the whole request's
tokens/s, the server process tree's CPU seconds per token (from /proc/PID/stat: sturdier
than wall time on a shared machine), and the drafts: hotprefix's vllm:spec_decode_*
counters (/metrics before and after), llama-server's `timings.draft_n` / `draft_n_accepted`.

    # the whole comparison (every configuration below started in turn, then all measured interleaved):
    .venv/bin/python benchmarks/spec_http.py --drive --json docs/bench/spec_http.json
    # one running server:
    .venv/bin/python benchmarks/spec_http.py --url http://127.0.0.1:8000 --label mine --json out.json
    .venv/bin/python benchmarks/spec_http.py --table docs/bench/spec_http.json

--drive starts every configuration of CONFIGS (hotprefix serve off and with ngram k=4;
llama-server with `--spec-type none` and each n-gram type, defaults and short-n variants)
on its own port, warms each with one request per workload (its prompt then cached), and
runs the rounds interleaved: in each round, each workload on every server in turn (the
order rotated each round), so that load on the machine falls on all of them alike; only
one request runs at a time. It needs llama-server (benchmarks/peers/llamaserver.sh install).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import httpx
from run_facts import facts
from spec_prompts import ROOT, WORKLOADS, prompts

from hotprefix import metric_names as N

MAX_TOKENS = 96
SPEC_COUNTERS = (N.SPEC_DRAFTS, N.SPEC_DRAFT_TOKENS, N.SPEC_ACCEPTED_TOKENS)


@dataclass(frozen=True)
class Stream:
    """What one streamed chat completion returned."""

    first_s: float | None  # seconds from the request's start to its first content, and to its last
    last_s: float | None
    tokens: int  # completion tokens: the usage's count, else the content chunks seen
    text: str
    finish_reason: str | None
    timings: dict = field(default_factory=dict)  # llama-server's `timings`, {} from other servers


def read_stream(lines: Iterable[tuple[float, str]]) -> Stream:
    """A Stream from server-sent-event lines, each with its seconds since the request's
    start. Raises ValueError for a `data:` line that is not JSON."""
    first = last = finish = usage = None
    text, chunks, timings = "", 0, {}
    for t, line in lines:
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                first = t if first is None else first
                last, text, chunks = t, text + content, chunks + 1
            finish = choice.get("finish_reason") or finish
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    tokens = usage["completion_tokens"] if usage else chunks
    return Stream(first, last, tokens, text, finish, timings)


def decode_rate(s: Stream) -> float | None:
    """Tokens after the first over the seconds from the first token to the last (None
    when there is no interval to divide by)."""
    if s.first_s is None or s.last_s is None or s.last_s <= s.first_s or s.tokens < 2:
        return None
    return (s.tokens - 1) / (s.last_s - s.first_s)


def cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) from a /proc/PID/stat line (the name in parentheses may
    hold spaces and parentheses: the fields are counted after the last ')')."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), state being 3


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of pid and its live descendants. Raises OSError when pid is gone."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_ticks(Path(f"/proc/{p}/stat").read_text())
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            if p == pid:
                raise
    return total / os.sysconf("SC_CLK_TCK")


def spec_counters(metrics: str) -> tuple[float, float, float]:
    """(drafts, draft tokens, accepted tokens) from a Prometheus page: vllm:spec_decode_*
    (or hotprefix:), summed over label sets; zeros where absent."""
    vals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(None, 1)[0].split("{")[0], line.rsplit(None, 1)[1]
        for prefix in N.PEER_PREFIXES:
            key = name.removeprefix(prefix).removesuffix("_total")
            if name.startswith(prefix) and key in vals:
                vals[key] += float(value)
    return vals[N.SPEC_DRAFTS], vals[N.SPEC_DRAFT_TOKENS], vals[N.SPEC_ACCEPTED_TOKENS]


@dataclass(frozen=True)
class Sample:
    """One timed request."""

    config: str
    workload: str
    round: int
    tokens: int
    decode_tps: float | None
    request_tps: float
    cpu_ms_per_token: float | None
    drafts: float | None  # drafts / draft tokens / accepted: None where the server reports none
    draft_tokens: float | None
    accepted: float | None
    finish_reason: str | None
    load1: float
    text: str


def body(messages: list[dict], schema: dict | None, model: str, max_tokens: int = MAX_TOKENS) -> dict:
    """The chat completion request of a workload: greedy, streamed with usage; json's
    schema as response_format, ignore_eos on the others."""
    b = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
         "stream_options": {"include_usage": True}}
    if schema is None:
        b["ignore_eos"] = True
    else:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema}}
    return b


def stream_request(client: httpx.Client, url: str, payload: dict) -> tuple[Stream, float]:
    """POST one streamed chat completion; (its Stream, the request's seconds). Raises
    RuntimeError with the server's answer when it refuses the request."""
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:500]!r}")
        s = read_stream((time.perf_counter() - t0, line) for line in r.iter_lines())
    return s, time.perf_counter() - t0


@dataclass
class Target:
    """A server under measurement: its label, URL, model name and pid (None: no CPU time)."""

    label: str
    url: str
    model: str
    pid: int | None = None
    metrics: bool = False  # /metrics has vllm:spec_decode_* (hotprefix)

    def measure(self, client: httpx.Client, workload: str, payload: dict, rnd: int) -> Sample:
        """One timed request of `workload` (the counters and CPU time read around it)."""
        before = spec_counters(client.get(self.url + "/metrics").text) if self.metrics else None
        cpu = tree_cpu_s(self.pid) if self.pid else None
        s, secs = stream_request(client, self.url, {**payload, "model": self.model})
        cpu = tree_cpu_s(self.pid) - cpu if self.pid else None
        drafts = None
        if before is not None:
            after = spec_counters(client.get(self.url + "/metrics").text)
            drafts = tuple(a - b for a, b in zip(after, before))
        elif "draft_n" in s.timings:
            drafts = (None, s.timings["draft_n"], s.timings.get("draft_n_accepted"))
        d = drafts or (None, None, None)
        return Sample(self.label, workload, rnd, s.tokens, decode_rate(s), s.tokens / secs,
                      cpu * 1e3 / s.tokens if cpu is not None and s.tokens else None, *d, s.finish_reason,
                      os.getloadavg()[0], s.text)


def run(targets: list[Target], loads: dict[str, tuple[list[dict], dict | None]], rounds: int,
        log=print) -> list[Sample]:
    """A warm-up request per workload on every target, then `rounds` rounds: each workload
    on every target in turn, the targets' order rotated each round. Every Sample, in order."""
    samples: list[Sample] = []
    # a fresh connection each request: a kept-alive one the server has just closed fails the next request
    with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for t in targets:
            for messages, schema in loads.values():
                stream_request(client, t.url, body(messages, schema, t.model))
            log(f"warmed {t.label}", flush=True)
        for rnd in range(rounds):
            for name, (messages, schema) in loads.items():
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for t in order:
                    s = t.measure(client, name, body(messages, schema, t.model), rnd)
                    samples.append(s)
                    log(f"round {rnd} {name:6s} {t.label:28s} {s.decode_tps or 0:6.1f} tok/s, "
                        f"{s.cpu_ms_per_token or 0:5.1f} CPU ms/token, {s.tokens} tokens, "
                        f"accepted {s.accepted}/{s.draft_tokens}, load {s.load1:.2f}", flush=True)
    return samples


def median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise(samples: list[dict], tokenize=None) -> dict[str, dict[str, dict]]:
    """Per workload, per config: medians of decode tok/s, request tok/s and CPU ms/token;
    the token counts seen; the drafts of the last round; and, given `tokenize`, how many
    leading tokens of its last text equal the first config's (the reference)."""
    out: dict[str, dict[str, dict]] = {}
    for s in samples:
        row = out.setdefault(s["workload"], {}).setdefault(s["config"], {"runs": []})
        row["runs"].append(s)
    for rows in out.values():
        ref = next(iter(rows.values()))["runs"][-1]["text"]
        for row in rows.values():
            runs = row.pop("runs")
            last = runs[-1]
            row.update(decode_tps=median([r["decode_tps"] for r in runs]),
                       request_tps=median([r["request_tps"] for r in runs]),
                       cpu_ms_per_token=median([r["cpu_ms_per_token"] for r in runs]),
                       tokens=sorted({r["tokens"] for r in runs}), same_text=len({r["text"] for r in runs}) == 1,
                       drafts=last["drafts"], draft_tokens=last["draft_tokens"], accepted=last["accepted"],
                       rounds=len(runs))
            if tokenize is not None:
                row["match"] = len(os.path.commonprefix([tokenize(last["text"]), tokenize(ref)]))  # any sequences
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict[str, dict[str, dict]], spec_label: str | None = None) -> str:
    """A Markdown table: a row per config, a column per workload, each cell `decode tok/s;
    CPU ms/token; accepted/draft tokens (last round); tokens matching the first config's`;
    then, given spec_label, its decode rate over the best llama-server config's."""
    configs = list(next(iter(summary.values())))
    rows = ["| config | " + " | ".join(summary) + " |", "|---|" + "---|" * len(summary)]
    for c in configs:
        cells = []
        for rows_of in summary.values():
            r = rows_of[c]
            acc = "-" if r["draft_tokens"] is None else f"{_fmt(r['accepted'], '.0f')}/{r['draft_tokens']:.0f}"
            n = "/".join(map(str, r["tokens"]))
            match = f"; {r['match']}/{n} match" if "match" in r else f"; {n} tokens"
            cells.append(f"{_fmt(r['decode_tps'], '.1f')}; {_fmt(r['cpu_ms_per_token'], '.1f')}; {acc}{match}")
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    if spec_label:
        cells = []
        for rows_of in summary.values():
            peers = {c: r["decode_tps"] for c, r in rows_of.items() if c.startswith("llama") and r["decode_tps"]}
            best = max(peers, key=peers.get) if peers else None
            mine = rows_of[spec_label]["decode_tps"]
            cells.append(f"**{mine / peers[best]:.2f}x** ({best})" if best and mine else "-")
        rows.append(f"| {spec_label} / best llama-server | " + " | ".join(cells) + " |")
    return "\n".join(rows)


class Server(Enum):
    """Which server a Config starts."""

    HOTPREFIX = "hotprefix"
    LLAMA = "llama-server"


@dataclass(frozen=True)
class Config:
    """A server configuration --drive starts: its label, server and the server's arguments."""

    label: str
    server: Server
    args: tuple[str, ...] = ()


HOTPREFIX_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPEC_LABEL = "hotprefix ngram k=4"


def _llama(t: str, *knobs: str) -> Config:
    label = f"llama {t}" + ("" if not knobs else " " + " ".join(f"{k.rsplit('-', 1)[-1]}={v}" for k, v in
                                                                zip(knobs[::2], knobs[1::2])))
    return Config(label, Server.LLAMA, ("--spec-type", t, *knobs))


CONFIGS = (
    Config("hotprefix off", Server.HOTPREFIX),
    Config(SPEC_LABEL, Server.HOTPREFIX, ("--speculative-config", json.dumps(HOTPREFIX_SPEC))),
    _llama("none"),
    _llama("ngram-simple"),
    _llama("ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"),
    _llama("ngram-map-k"),
    _llama("ngram-map-k", "--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "16"),
    _llama("ngram-map-k4v"),
    _llama("ngram-mod"),
    _llama("ngram-mod", "--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16"),
    _llama("ngram-cache"),
)


def command(c: Config, port: int) -> list[str]:
    """The command line that serves c on 127.0.0.1:port: hotprefix serve from this checkout's
    venv, llama-server through benchmarks/peers/llamaserver.sh (its --no-repack rule, 2
    threads here; one slot of 8k tokens: one request at a time)."""
    if c.server is Server.HOTPREFIX:
        return [str(ROOT / ".venv" / "bin" / "hotprefix"), "serve", "--port", str(port), "--kv-cache-memory", "512MiB",
                *c.args]
    return ["bash", str(ROOT / "benchmarks" / "peers" / "llamaserver.sh"), "serve", str(port), "-c", "8192", "-np", "1",
            *c.args]


def start(configs: Iterable[Config], port: int, logs: Path, threads: int | None = None
          ) -> tuple[list[subprocess.Popen], list[Target]]:
    """Start every config in turn (each up before the next starts), on port, port + 1, ...;
    `threads`: each server's compute threads (OMP_NUM_THREADS, LLAMASERVER_THREADS; None:
    their defaults, the cores). Raises RuntimeError (after stopping them all) when one ends
    before it answers."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads), "LLAMASERVER_THREADS": str(threads)}
                              if threads else {}))
    procs: list[subprocess.Popen] = []
    targets: list[Target] = []
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for i, c in enumerate(configs):
            url = f"http://127.0.0.1:{port + i}"
            log = open(logs / f"{c.label.replace(' ', '_').replace('=', '')}.log", "w")
            p = subprocess.Popen(command(c, port + i), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=env)
            procs.append(p)
            model = wait_up(p, url, log.name)
            targets.append(Target(c.label, url, model, p.pid, metrics=c.server is Server.HOTPREFIX))
            print(f"started {c.label} on {url} (pid {p.pid})", flush=True)
    except BaseException:
        stop(procs)
        raise
    return procs, targets


def wait_up(p: subprocess.Popen, url: str, log: str) -> str:
    """The model name once url/v1/models answers. Raises RuntimeError when p ends first."""
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"{url} ended ({p.returncode}) before it answered: see {log}")
        try:
            r = httpx.get(url + "/v1/models", timeout=5)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    """End each server's process group and wait for it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def tokenizer():
    """The default model's tokenizer (as hotprefix converts it from the GGUF): the prompts'
    document length and the outputs' token comparison."""
    from hotprefix.model.default_model import default_model_path
    from hotprefix.model.loader import gguf_tokenizer

    tok = gguf_tokenizer(default_model_path())
    return lambda text: tok.encode(text, add_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drive", action="store_true", help="start every configuration of CONFIGS and measure them all")
    ap.add_argument("--url", help="measure this running server instead")
    ap.add_argument("--label", default="server", help="its name in the results (with --url)")
    ap.add_argument("--table", type=Path, help="print the Markdown table of a results file")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8830, help="--drive: the first port (one a configuration)")
    ap.add_argument("--configs", help="--drive: only these configuration labels, comma-separated")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--threads", type=int, help="--drive: each server's threads (default: the cores)")
    a = ap.parse_args(argv)
    if a.table:
        res = json.loads(a.table.read_text())
        print(table(res["summary"], SPEC_LABEL if SPEC_LABEL in next(iter(res["summary"].values())) else None))
        return 0
    if not (a.drive or a.url):
        ap.error("--drive, --url or --table")
    tokenize = tokenizer()
    loads = {k: v for k, v in prompts(tokenize).items() if k in a.workloads.split(",")}
    t0, load0, cpu0 = time.time(), os.getloadavg(), {}
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still stops the servers (finally)
    try:
        if a.drive:
            configs = [c for c in CONFIGS if not a.configs or c.label in a.configs.split(",")]
            procs, targets = start(configs, a.port, (a.json or Path("/tmp/spec_http.json")).with_suffix(".logs"),
                                   a.threads)
        else:
            model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
            targets = [Target(a.label, a.url.rstrip("/"), model)]
        samples = [asdict(s) for s in run(targets, loads, a.rounds)]
        cpu0 = {t.label: tree_cpu_s(t.pid) for t in targets if t.pid}
    finally:
        stop(procs)
    summary = summarise(samples, tokenize)
    print(table(summary, SPEC_LABEL if a.drive else None))
    print(f"load average {load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {time.time() - t0:.0f} s")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "configs": [{"label": c.label, "server": c.server.value, "args": list(c.args)} for c in CONFIGS]
            if a.drive else [{"label": a.label, "url": a.url}], "rounds": a.rounds, "max_tokens": MAX_TOKENS,
            "threads": a.threads or len(os.sched_getaffinity(0)),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "seconds": round(time.time() - t0),
            "load_start": load0, "load_end": os.getloadavg(), "server_cpu_s": cpu0, **facts(),
            "summary": summary, "samples": samples}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
