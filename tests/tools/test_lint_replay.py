"""lint's prediction against what a real server measures: three logs replayed, as sent and
after lint's fix, to a server whose pool is too small for the working set and to one
that never evicts. lint reads the server's own request log (hashes, and text with
--request-log-prompts) and must land within 2 points of the server's measured rate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from hotprefix.tokenizers.prompt_encoder import PromptEncoder
from hotprefix.tools.lint import Linter, read_requests
from tests.server.conftest import start_server
from tests.tools.lint_logs import LOGS

BLOCK = 16
SMALL, LARGE = 40, 2048  # blocks: 640 tokens (the longest prompt is ~415), and more than every log needs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.conftest import build_tiny_model

    d = tmp_path_factory.mktemp("tiny-1k")
    build_tiny_model(d, "llama", max_position_embeddings=1024)
    return d


@pytest.fixture(scope="module")
def encoder(model):
    from transformers import AutoTokenizer

    return PromptEncoder(AutoTokenizer.from_pretrained(str(model)))


def replay(model: Path, num_blocks: int, bodies: list[dict], log: Path) -> float:
    """Send bodies one by one to a fresh server writing `log`; the hit rate it measured."""
    s = start_server(model, block_size=BLOCK, num_blocks_override=num_blocks, max_model_len=1024,
                     server_kw={"request_log": str(log), "request_log_prompts": True})
    try:
        for b in bodies:
            path = "/chat/completions" if "messages" in b else "/completions"
            r = httpx.post(s.v1 + path, json={**b, "max_tokens": 1, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        s.stop()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == len(bodies)
    return sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)


def lint_log(encoder: PromptEncoder, log: Path, strip_text: bool = False) -> tuple[dict, list[dict]]:
    data = read_requests(log)
    entries = [replace(e, text=None) for e in data.entries] if strip_text else data.entries
    linter = Linter(encoder, data.block_size, size=data.size)
    return linter.report(linter.from_log_entries(entries))


@pytest.mark.parametrize("pool", [SMALL, LARGE], ids=["evicting", "unbounded"])
@pytest.mark.parametrize("name", list(LOGS))
def test_prediction_within_2_points_as_sent_and_fixed(name, pool, model, encoder, tmp_path):
    sent_log, fixed_log = tmp_path / "sent.jsonl", tmp_path / "fixed.jsonl"
    measured_sent = replay(model, pool, LOGS[name](), sent_log)
    rep, fixed = lint_log(encoder, sent_log)
    assert rep["text"] and rep["cache_blocks"] == pool and rep["block_size"] == BLOCK
    assert rep["hit_rate_measured"] == pytest.approx(measured_sent)
    assert abs(rep["hit_rate_as_sent"] - measured_sent) <= 0.02, (rep["hit_rate_as_sent"], measured_sent)
    # From the hashes alone (a log without --request-log-prompts), the same prediction.
    hashes_only, no_fix = lint_log(encoder, sent_log, strip_text=True)
    assert not hashes_only["text"] and no_fix == [] and hashes_only["hit_rate_if_fixed"] is None
    assert abs(hashes_only["hit_rate_as_sent"] - measured_sent) <= 0.02
    # The fix finds the volatile content of each log and gains; the server agrees.
    assert {f["kind"] for f in rep["volatile_before_break"]} & {"timestamp", "id"}
    assert rep["hit_rate_if_fixed"] > rep["hit_rate_as_sent"] + 0.05
    measured_fixed = replay(model, pool, fixed, fixed_log)
    assert abs(rep["hit_rate_if_fixed"] - measured_fixed) <= 0.02, (rep["hit_rate_if_fixed"], measured_fixed)
    if pool == SMALL:  # the pool is too small for the working set: eviction costs hits the unbounded cache keeps
        assert rep["hit_rate_unbounded"] > rep["hit_rate_as_sent"] or rep["hit_rate_if_fixed_unbounded"] > \
            rep["hit_rate_if_fixed"]
