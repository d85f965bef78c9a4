"""The collapse case of issue 41 over HTTP, for any OpenAI-compatible server (hotprefix,
llama-server, ...): benchmarks/kv_groups.py's workload measured through a server's own
prefix cache instead of the engine's Scheduler in process.

kv_groups.Workload: 16 chat sessions share a 2,000-word system prompt and take 6 turns each: a 150-word user
turn, then a 50-token answer (`max_tokens` 50 with `ignore_eos`, greedy), the answer text
the server returned kept in the history. Each turn's prompt is the whole conversation so
far, sent to /v1/completions as plain text (one tokenization of one string on every
server: no chat template in between). Interleaved as kv_groups.py runs it: every session's
turn t before any turn t + 1, 4 requests in flight at once (sessions in order). The text is
random words from a fixed list with a fixed seed, each word one token of SmolLM2's
vocabulary (the tokenizer of benchmarks/make_gguf.py's files), so every server gets the
same user text and a word is about a token.

Per request it records the prompt tokens and the cached prompt tokens the server reports:
`usage.prompt_tokens_details.cached_tokens` (hotprefix, vLLM) or llama-server's `timings`
(`cache_n` cached, `prompt_n` computed; its `usage` has no details), then the prompt-token
hit rate overall and per turn.

    .venv/bin/python benchmarks/collapse_http.py http://127.0.0.1:8000 --label hotprefix \\
        --json docs/bench/collapse/hotprefix.json [--note "how the server was started"]
    .venv/bin/python benchmarks/collapse_http.py --table docs/bench/collapse/*.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kv_groups import Workload  # the collapse case's shape, one owner for both benchmarks

# Common English words, each a single token (with its leading space) in SmolLM2's vocabulary.
WORDS = tuple("""time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others
level office door health person art war history party result change morning reason research girl
guy moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect use class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity star table need
court oil situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population""".split())


SEED = 41  # of the text: every server gets the same words


def words(rng: random.Random, n: int) -> str:
    """n words from WORDS, space-separated (a leading space on each, as the tokenizer sees them)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def system_text(w: Workload, seed: int = SEED) -> str:
    """The shared system prompt: w.system_tokens words."""
    return "System:" + words(random.Random(seed), w.system_tokens)


def user_text(w: Workload, session: int, turn: int, seed: int = SEED) -> str:
    """Session's user turn (w.user_tokens words): its own seed, so every server gets the same text."""
    return words(random.Random(seed * 1_000_003 + session * 1_000 + turn), w.user_tokens)


def prompt(system: str, history: list[tuple[str, str]], user: str) -> str:
    """The conversation so far (user turns and the answers returned) and the new user turn."""
    past = "".join(f"\n\nUser:{u}\nAssistant:{a}" for u, a in history)
    return f"{system}{past}\n\nUser:{user}\nAssistant:"


def cached_tokens(body: dict) -> tuple[int, int, str]:
    """(prompt tokens, cached prompt tokens, where the count came from) of a completion's
    response. Raises KeyError when the response reports neither."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return usage["prompt_tokens"], details["cached_tokens"], "usage.prompt_tokens_details"
    t = body["timings"]
    return t["cache_n"] + t["prompt_n"], t["cache_n"], "timings"


@dataclass(frozen=True)
class Record:
    """One request's outcome."""

    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    source: str
    seconds: float
    answer: str


def hit_rates(records: list[Record]) -> dict:
    """Cached prompt tokens / prompt tokens, overall and per turn (turn -> rate)."""
    def rate(rs: list[Record]) -> float:
        total = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / total if total else 0.0

    turns = sorted({r.turn for r in records})
    return {"overall": rate(records), "per_turn": {t: rate([r for r in records if r.turn == t]) for t in turns},
            "prompt_tokens": sum(r.prompt_tokens for r in records),
            "cached_tokens": sum(r.cached_tokens for r in records)}


def complete(url: str, model: str | None, text: str, w: Workload, timeout: float) -> tuple[dict, float]:
    """POST one greedy completion (a fresh connection); its JSON body and seconds. Raises
    RuntimeError with the server's answer when it refuses or fails the request."""
    payload = {"prompt": text, "max_tokens": w.answer_tokens, "temperature": 0.0, "ignore_eos": True}
    if model:
        payload["model"] = model
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", json.dumps(payload).encode(),
                                 {"Content-Type": "application/json", "Connection": "close"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} after {time.perf_counter() - t0:.1f} s: {e.read()[:500]!r}") from e


def run(url: str, w: Workload, model: str | None = None, timeout: float = 3600.0, log=print) -> list[Record]:
    """The whole workload against url; one Record per request, in order of turn then session."""
    system = system_text(w)
    history: dict[int, list[tuple[str, str]]] = {s: [] for s in range(w.sessions)}
    records: list[Record] = []

    def one(s: int, t: int) -> Record:
        user = user_text(w, s, t)
        body, secs = complete(url, model, prompt(system, history[s], user), w, timeout)
        answer = body["choices"][0]["text"]
        p, c, src = cached_tokens(body)
        history[s].append((user, answer))  # only this session's thread touches history[s] in turn t
        return Record(s, t, p, c, body["usage"]["completion_tokens"], src, secs, answer)

    with ThreadPoolExecutor(w.max_running) as pool:
        for t in range(w.turns):
            turn = list(pool.map(one, range(w.sessions), [t] * w.sessions))
            records += turn
            log(f"turn {t}: hit rate {hit_rates(turn)['overall']:.1%} "
                f"({sum(r.cached_tokens for r in turn)}/{sum(r.prompt_tokens for r in turn)} prompt tokens), "
                f"{max(r.seconds for r in turn):.1f} s the slowest request", flush=True)
    return records


def table(paths: list[Path]) -> str:
    """A Markdown table of results files: each server's hit rate overall and per turn."""
    runs = [json.loads(p.read_text()) for p in paths]
    turns = sorted({int(t) for r in runs for t in r["hit_rate"]["per_turn"]})
    rows = ["| server | prompt tokens | cached | overall | " + " | ".join(f"turn {t}" for t in turns) + " |",
            "|---|---|---|---|" + "---|" * len(turns)]
    for r in runs:
        h = r["hit_rate"]
        rows.append(f"| {r['label']} | {h['prompt_tokens']:,} | {h['cached_tokens']:,} | {h['overall']:.1%} | "
                    + " | ".join(f"{h['per_turn'][str(t)]:.1%}" for t in turns) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", nargs="?", help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--table", type=Path, nargs="+", help="print a Markdown table of these results files instead")
    ap.add_argument("--label", help="the server's name in the results")
    ap.add_argument("--json", type=Path, help="write the results (every request's record) here")
    ap.add_argument("--model", help="the request's model field (default: none sent)")
    ap.add_argument("--note", default="", help="how the server was started, kept in the results")
    ap.add_argument("--sessions", type=int, default=Workload.sessions)
    ap.add_argument("--turns", type=int, default=Workload.turns)
    ap.add_argument("--concurrency", type=int, default=Workload.max_running, help="requests in flight at once")
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return 0
    if not (a.url and a.label):
        ap.error("a URL and --label are needed to run the workload")
    w = Workload(sessions=a.sessions, turns=a.turns, max_running=a.concurrency)
    t0 = time.time()
    records = run(a.url, w, a.model)
    rates = hit_rates(records)
    print(f"{a.label}: hit rate {rates['overall']:.1%} overall; per turn "
          + ", ".join(f"{t}: {r:.1%}" for t, r in rates["per_turn"].items()))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "label": a.label, "url": a.url, "note": a.note, "workload": asdict(w), "seed": SEED,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "seconds": round(time.time() - t0, 1),
            "hit_rate": rates, "requests": [asdict(r) for r in records]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
