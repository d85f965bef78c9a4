"""`hotprefix lint` on crafted logs: recognisers, the idempotent fix, the cache replay,
and the command line (bodies and the server's own log)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid

import pytest

from hotprefix.tokenizers.prompt_encoder import PromptEncoder
from hotprefix.tools.cache_sim import CacheSize, SimRequest, replay
from hotprefix.tools.lint import Linter, token_lcps
from hotprefix.tools.volatile import Placement, content_end, find_volatile, move, placed, spans_of

SYSTEM = "You are the support assistant. Answer briefly. "


def crafted(n: int = 16, seed: int = 0) -> list[dict]:
    """Chat requests whose system prompt starts with a timestamp (first half) or a
    request UUID (second half) in front of a shared instruction."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        head = (f"Current time: 2026-11-22T14:{i:02d}:{rng.randint(10, 59)}Z" if i < n // 2
                else f"Request {uuid.UUID(int=rng.getrandbits(128))}")
        rows.append({"messages": [{"role": "system", "content": f"{head}\n{SYSTEM}"},
                                  {"role": "user", "content": f"question {i}?"}]})
    return rows


@pytest.fixture(scope="module")
def encoder(tiny_llama):
    from transformers import AutoTokenizer

    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_llama[0])))


@pytest.fixture(scope="module")
def linter(encoder):
    return Linter(encoder, block_size=4)


def report(linter: Linter, bodies: list[dict]) -> tuple[dict, list[dict]]:
    return linter.report([linter.prepare(b) for b in bodies])


# -- recognisers ----------------------------------------------------------------------------

RECOGNISED = [  # (text, kind, the span it must find)
    ("at 2026-11-22T14:03:11Z now", "timestamp", "2026-11-22T14:03:11Z"),
    ("at 2026-11-22 14:03:11.123+01:00 now", "timestamp", "2026-11-22 14:03:11.123+01:00"),
    ("Date: Mon, 22 Nov 2026 14:03:11 GMT", "timestamp", "Mon, 22 Nov 2026 14:03:11 GMT"),
    ("[22/Nov/2026:14:03:11 +0000] GET", "timestamp", "22/Nov/2026:14:03:11 +0000"),
    ("sent Nov 22, 2026 2:03 PM by", "timestamp", "Nov 22, 2026 2:03 PM"),
    ("Today is 2026-11-22.", "date", "2026-11-22"),
    ("Today is 11/22/2026.", "date", "11/22/2026"),
    ("Heute ist 22.11.2026.", "date", "22.11.2026"),
    ("Today is Monday, November 22, 2026.", "date", "Monday, November 22, 2026"),
    ("on 22nd of November 2026 we", "date", "22nd of November 2026"),
    ("at 14:05 sharp", "time", "14:05"),
    ("at 2:05 PM sharp", "time", "2:05 PM"),
    ("ts 1795356027 and", "unix_time", "1795356027"),
    ("ms 1795356027123 and", "unix_time", "1795356027123"),
    ("trace 123e4567-e89b-12d3-a456-426614174000 ok", "uuid", "123e4567-e89b-12d3-a456-426614174000"),
    ("User ID: u-43003\n", "id", "User ID: u-43003"),
    ("user_id=ab12cd;", "id", "user_id=ab12cd"),
    ("Session: s_9f8e7d12 open", "id", "Session: s_9f8e7d12"),
    ("your order #A-12345 shipped", "id", "order #A-12345"),
    ("Request ID: req_8KfT2x", "id", "Request ID: req_8KfT2x"),
    ("see req-9f8e7d6c here", "id", "req-9f8e7d6c"),
    ("commit 9fceb02d0ae598e95dc970b74767f19372d61af8 fixed", "hex_id", "9fceb02d0ae598e95dc970b74767f19372d61af8"),
    ("nonce=8fJ2kLm9QpX3aZ7bT1 done", "nonce", "8fJ2kLm9QpX3aZ7bT1"),
    ("Turn 42 of the chat", "counter", "42"),
]


@pytest.mark.parametrize(("text", "kind", "span"), RECOGNISED, ids=[f"{k}:{s}" for _, k, s in RECOGNISED])
def test_each_recogniser_finds_its_span_whole(text, kind, span):
    found = [(v.kind, v.text) for v in find_volatile(text)]
    assert found[0] == (kind, span), found


def test_recognisers_leave_ordinary_text_alone():
    text = "HTTPRequestHandler handles requests. The user asked politely. Call me at noon, version two."
    assert find_volatile(text) == []


def test_volatile_patterns_in_one_text():
    kinds = [v.kind for v in find_volatile(
        "at 2026-11-22T14:03:11Z id 123e4567-e89b-12d3-a456-426614174000 user_id=ab12cd on 11/22/2026 "
        "at 14:05 ts 1795356027 count 42 req-9f8e7d6c")]
    assert kinds == ["timestamp", "uuid", "id", "date", "time", "unix_time", "counter", "id"]


# -- the fix ---------------------------------------------------------------------------------

KIND_HEADS = {  # kind -> a system-prompt head holding that kind of volatile value (request i, rng)
    "timestamp": lambda i, r: f"Current time: 2026-11-22T14:{i:02d}:{r.randint(10, 59)}Z",
    "date": lambda i, r: f"Today is {r.randint(1, 28)}.{r.randint(1, 12)}.2026, a work day.",
    "time": lambda i, r: f"It is {r.randint(10, 23)}:{r.randint(10, 59)} now.",
    "unix_time": lambda i, r: f"Epoch {1795356027 + r.randint(1, 10**6)}.",
    "uuid": lambda i, r: f"Trace {uuid.UUID(int=r.getrandbits(128))}",
    "id": lambda i, r: f"User ID: u-{r.randint(10000, 99999)}",
    "hex_id": lambda i, r: f"Build {r.getrandbits(64):016x} deployed.",
    "nonce": lambda i, r: "Nonce " + "".join(r.choice("abcXYZ0123456789") for _ in range(6)) + "aZ9bY8cX7dW6",
    "counter": lambda i, r: f"Visit number {r.randint(100, 999)}.",
}


def kind_log(kind: str, n: int = 10) -> list[dict]:
    rng = random.Random(kind)
    return [{"messages": [{"role": "system", "content": f"{KIND_HEADS[kind](i, rng)}\n{SYSTEM}{SYSTEM}"},
                          {"role": "user", "content": "What are your opening hours?"}]} for i in range(n)]


@pytest.mark.parametrize("kind", list(KIND_HEADS))
def test_the_fix_is_idempotent_for_every_finding_kind(kind, linter):
    reqs = [linter.prepare(b) for b in kind_log(kind)]
    assert any(f.span.kind == kind for f in linter.culprits(reqs)), [f.span for f in linter.culprits(reqs)]
    fixed, helped = linter.fix(reqs)
    assert kind in helped and linter.rate(fixed) > linter.rate(reqs) + 0.2
    again, helped_again = linter.fix(fixed)
    assert helped_again == set() and [r.body for r in again] == [r.body for r in fixed]
    for r in fixed:  # the moved clause is whole and is where the fix puts it
        assert all(placed(r.body, loc, v) for loc, v in spans_of(r.body) if v.kind == kind)


def test_a_move_that_gains_nothing_is_not_kept(linter):
    rng = random.Random(5)
    bodies = [{"prompt": f"Request ID: req-{rng.getrandbits(32):08x}\n{rng.random()} unique question"}
              for _ in range(8)]
    reqs = [linter.prepare(b) for b in bodies]
    fixed, helped = linter.fix(reqs)
    assert helped == set() and [r.body for r in fixed] == bodies


def test_move_keeps_the_label_and_the_turn_structure(encoder):
    body = {"messages": [{"role": "system", "content": "Be brief. Current time: 2026-11-22T14:03:11Z. Be kind."},
                         {"role": "user", "content": "Hi?"}]}
    (loc, v), = spans_of(body)
    assert move(body, loc, v, Placement.END)["messages"] == [
        {"role": "system", "content": "Be brief. Be kind."},
        {"role": "user", "content": "Hi?\nCurrent time: 2026-11-22T14:03:11Z."}]
    assert move(body, loc, v, Placement.FIRST_TURN)["messages"][1]["content"] == \
        "Current time: 2026-11-22T14:03:11Z.\nHi?"
    # A rendered prompt: the clause goes before the closing special tokens, never into the assistant's turn.
    text = "<|im_start|>system\nUser ID: u-43003\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n" \
           "<|im_start|>assistant\n"
    specials = encoder.special_tokens
    assert content_end(text, specials) == text.index("Hi?") + 3
    rendered = {"prompt": text}
    (loc, v), = spans_of(rendered)
    assert move(rendered, loc, v, Placement.END, specials)["prompt"] == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?\nUser ID: u-43003<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert move(rendered, loc, v, Placement.FIRST_TURN, specials)["prompt"] == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nUser ID: u-43003\nHi?<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_finds_timestamp_and_uuid_with_positions(linter):
    rep, fixed = report(linter, crafted())
    kinds = {f["kind"]: f for f in rep["volatile_before_break"]}
    assert set(kinds) == {"timestamp", "uuid"}
    ts = kinds["timestamp"]["examples"][0]
    assert ts["snippet"].startswith("2026-11-22T14:") and ts["char_pos"] == len("<|im_start|>system\nCurrent time: ")
    assert kinds["uuid"]["examples"][0]["char_pos"] == len("<|im_start|>system\nRequest ")
    # Every prompt but the first of each kind breaks inside its volatile content (the first
    # UUID prompt breaks at "Request" vs "Current": a structural difference, not volatile).
    assert kinds["timestamp"]["requests"] == 7 and kinds["uuid"]["requests"] == 7
    assert rep["hit_rate_if_fixed"] > rep["hit_rate_as_sent"] + 0.2
    assert rep["cache"] == "an unbounded cache (no eviction)"
    # The fix moved the volatile clauses out of the system prompts: they now agree.
    assert {f["messages"][0]["content"] for f in fixed} == {SYSTEM}


# -- the cache replay ------------------------------------------------------------------------


def test_unbounded_replay_follows_the_engine_rules():
    a, b = [b"a0", b"a1"], [b"a0", b"a1", b"b2"]
    sim = replay([SimRequest(a, 10), SimRequest(b, 14), SimRequest(a, 10)], block_size=4)
    assert sim.hits == [0, 8, 8]  # a again: capped at (10 - 1) // 4 = 2 blocks
    assert sim.shared_blocks == [0, 2, 2]
    assert token_lcps([list(range(10)), list(range(10)) + [99], list(range(5))]) == [0, 10, 5]


def test_pool_replay_evicts_least_recently_released_last_blocks_first():
    bs = 2
    x = SimRequest([b"x0", b"x1"], 5)  # 3 blocks: x0, x1 and a partial one
    y = SimRequest([b"y0", b"y1"], 5)
    size = CacheSize(device_blocks=4)
    # x then y: y's 3 blocks take the never-used block, then x's released blocks tail first
    # (the partial, then x1): x0 survives, x1 does not.
    assert replay([x, y, x], bs, size).hits == [0, 0, 2]
    assert replay([x, y, y], bs, size).hits == [0, 0, 4]
    # With a host tier, x1 is offloaded when evicted and comes back from it.
    assert replay([x, y, x], bs, CacheSize(device_blocks=4, host_blocks=2)).hits == [0, 0, 4]
    assert replay([x, y, x], bs, CacheSize()).hits == [0, 0, 4]
    big = SimRequest([b"z0", b"z1", b"z2", b"z3", b"z4"], 11)
    assert replay([big], bs, size).too_big == 1


def test_the_unbounded_replay_is_the_engine_with_a_pool_that_never_evicts():
    """The unbounded cache is computed without a pool; the engine's scheduler with a pool
    large enough that nothing is evicted gives the same hits (outputs' blocks included)."""
    rng, bs = random.Random(11), 4
    reqs = []
    for i in range(60):
        shared, own = rng.randint(0, 5), rng.randint(0, 3)
        hashes = [b"g%d-%d" % (i % 3, k) for k in range(shared)] + [b"r%d-%d" % (i, k) for k in range(own)]
        reqs.append(SimRequest(hashes, (shared + own) * bs + rng.randint(1, bs - 1), rng.choice([1, 2, 7])))
    never_evicts = CacheSize(device_blocks=sum(-(-r.computed_tokens // bs) for r in reqs))
    unbounded, engine = replay(reqs, bs), replay(reqs, bs, never_evicts)
    assert engine.hits == unbounded.hits and engine.shared_blocks == unbounded.shared_blocks
    assert sum(unbounded.hits) > 0 and engine.too_big == 0


def test_the_replay_runs_the_engine_admission_with_its_host_tier():
    """A request's blocks past its known hashes (its output) are cached by the engine too:
    evicted (last block first), they take host-tier slots, and a host tier of two slots
    then no longer holds the first prompt block a later request needs."""
    bs = 2
    x = SimRequest([b"x0", b"x1"], 4, output_tokens=3)  # computes 6 tokens: x0, x1 and one output block
    y = SimRequest([b"y0", b"y1", b"y2"], 6)
    assert replay([x, y, x], bs, CacheSize(device_blocks=3, host_blocks=3)).hits == [0, 0, 2]
    assert replay([x, y, x], bs, CacheSize(device_blocks=3, host_blocks=2)).hits == [0, 0, 0]


def test_prediction_matches_a_real_server_within_2_points(linter, tiny_llama):
    """Bodies (not a server log) replayed to a real server, as sent and fixed; lint's
    prediction for a pool the size of the server's."""
    import httpx

    from tests.server.conftest import start_server

    bodies = crafted(24, seed=3)
    small = Linter(linter.encoder, 4, size=CacheSize(device_blocks=48))
    rep, fixed = report(small, bodies)
    assert rep["cache"].startswith("48 blocks of 4 tokens")
    rates = {}
    for name, sent in (("fixed", fixed), ("sent", bodies)):
        s = start_server(tiny_llama[0], block_size=4, num_blocks_override=48, max_model_len=128)
        try:
            for b in sent:
                r = httpx.post(s.v1 + "/chat/completions", json={**b, "max_tokens": 1}, timeout=60)
                assert r.status_code == 200, r.text
            rates[name] = s.metric("prefix_cache_hits_total") / s.metric("prefix_cache_queries_total")
        finally:
            s.stop()
    assert abs(rates["fixed"] - rep["hit_rate_if_fixed"]) <= 0.02, (rates, rep["hit_rate_if_fixed"])
    assert abs(rates["sent"] - rep["hit_rate_as_sent"]) <= 0.02, (rates, rep["hit_rate_as_sent"])


# -- the command line ------------------------------------------------------------------------


def lint_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", *args], capture_output=True, text=True)


def test_cli_report_json_and_fixed_file(tmp_path, tiny_llama):
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in crafted()))
    out = tmp_path / "fixed.jsonl"
    r = lint_cli(str(log), "--model", str(tiny_llama[0]), "--block-size", "4", "--json", "--write-fixed", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["requests"] == 16 and {f["kind"] for f in rep["volatile_before_break"]} == {"timestamp", "uuid"}
    assert len(out.read_text().splitlines()) == 16
    # Linting the fixed file finds nothing more to move (the fix is idempotent end to end).
    again = tmp_path / "again.jsonl"
    r = lint_cli(str(out), "--model", str(tiny_llama[0]), "--block-size", "4", "--json", "--write-fixed", str(again))
    assert r.returncode == 0 and again.read_text() == out.read_text()
    text = lint_cli(str(log), "--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "64").stdout
    assert "volatile content where sharing breaks" in text and "timestamp" in text
    assert "assumed cache: 64 blocks of 4 tokens" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    r = lint_cli(str(bad), "--model", str(tiny_llama[0]))
    assert r.returncode == 2 and "neither `messages` nor `prompt`" in r.stderr
    old = tmp_path / "old.jsonl"
    old.write_text('{"request_id": "x", "prompt_tokens": 5, "cached_tokens": 0}\n')
    r = lint_cli(str(old), "--model", str(tiny_llama[0]))
    assert r.returncode == 2 and "without block hashes" in r.stderr


@pytest.mark.parametrize("row", [
    {"prefix": "x"}, {"prefix": [{"tokens": -1, "blocks": []}]}, {"prefix": [{"tokens": 5, "blocks": ["zz"]}]},
    {"prefix": [{"tokens": 5, "blocks": [1]}]}, {"prefix": [{"tokens": 5, "blocks": [], "text": 3}]},
    {"prefix": [{"tokens": 5, "blocks": []}], "kv": {"block_size": 0, "blocks": 5}},
    {"prefix": [{"tokens": 5, "blocks": []}], "time": "soon"},
], ids=["not-a-list", "negative", "not-hex", "not-a-string", "text-not-a-string", "zero-block-size", "bad-time"])
def test_a_damaged_log_row_is_named_not_a_traceback(row, tmp_path):
    from hotprefix.config import ConfigError
    from hotprefix.tools.lint import read_requests

    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=r"log.jsonl:1: a request-log row whose `prefix` or times are malformed"):
        read_requests(path)


def test_cli_cache_size_from_memory_and_host_tier(tmp_path, tiny_llama):
    """--kv-cache-memory becomes blocks as serve sizes its pool (the model's KV bytes per
    block); --host-blocks adds the host tier; --unbounded overrides both."""
    from hotprefix.tools.size import load_shape

    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in crafted()))
    per_block = load_shape(str(tiny_llama[0]))[1].kv.bytes_per_block("float32", 4)
    args = [str(log), "--model", str(tiny_llama[0]), "--block-size", "4", "--json"]
    r = lint_cli(*args, "--kv-cache-memory", str(40 * per_block), "--host-blocks", "16")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["cache_blocks"], rep["host_blocks"]) == (40, 16)
    assert rep["cache"].startswith("40 blocks of 4 tokens (160 tokens) + host tier 16 blocks")
    unb = json.loads(lint_cli(*args, "--num-blocks", "40", "--unbounded").stdout)
    assert unb["cache_blocks"] is None and unb["hit_rate_as_sent"] == rep["hit_rate_unbounded"]
    bad = lint_cli(*args, "--num-blocks", "0")
    assert bad.returncode == 2 and "at least one block" in bad.stderr
