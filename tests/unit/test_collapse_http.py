"""benchmarks/collapse_http.py's pure parts: the text of the collapse workload (the same for
every server, from fixed seeds), the prompt each turn sends, reading the cached prompt tokens
from hotprefix's and llama-server's responses, and the hit-rate arithmetic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))  # the script and kv_groups.py beside it
import collapse_http as bench  # noqa: E402


def test_text_is_fixed_by_the_seed_and_has_the_stated_words():
    w = bench.Workload()
    system = bench.system_text(w)
    assert system == bench.system_text(bench.Workload())
    assert system.startswith("System: ") and len(system.split()) == 1 + w.system_tokens
    assert all(word in bench.WORDS for word in system.split()[1:])
    user = bench.user_text(w, 3, 2)
    assert user == bench.user_text(w, 3, 2) and len(user.split()) == w.user_tokens
    assert user != bench.user_text(w, 3, 1) and user != bench.user_text(w, 2, 2)
    assert bench.system_text(w, seed=7) != system


def test_each_turn_extends_the_previous_prompt_with_the_answer_returned():
    first = bench.prompt("System: a b", [], " c d")
    assert first == "System: a b\n\nUser: c d\nAssistant:"
    second = bench.prompt("System: a b", [(" c d", " x\ty")], " e")
    assert second == first + " x\ty\n\nUser: e\nAssistant:"


def test_cached_tokens_from_usage_details_or_llamaserver_timings():
    hotprefix = {"usage": {"prompt_tokens": 2161, "completion_tokens": 50,
                           "prompt_tokens_details": {"cached_tokens": 2144}}}
    assert bench.cached_tokens(hotprefix) == (2161, 2144, "usage.prompt_tokens_details")
    timings_only = {"usage": {"prompt_tokens": 2161, "completion_tokens": 50},
                    "timings": {"cache_n": 1689, "prompt_n": 472}}
    assert bench.cached_tokens(timings_only) == (2161, 1689, "timings")
    with pytest.raises(KeyError):
        bench.cached_tokens({"usage": {"prompt_tokens": 3}})


def _record(turn: int, prompt: int, cached: int):
    return bench.Record(0, turn, prompt, cached, 50, "timings", 1.0, "")


def test_hit_rates_weigh_requests_by_prompt_tokens():
    records = [_record(0, 1000, 0), _record(0, 3000, 1500), _record(1, 2000, 2000)]
    rates = bench.hit_rates(records)
    assert rates["overall"] == 3500 / 6000
    assert rates["per_turn"] == {0: 1500 / 4000, 1: 1.0}
    assert (rates["prompt_tokens"], rates["cached_tokens"]) == (6000, 3500)
    assert bench.hit_rates([]) == {"overall": 0.0, "per_turn": {}, "prompt_tokens": 0, "cached_tokens": 0}


def test_table_has_a_row_per_results_file(tmp_path):
    records = [_record(0, 1000, 0), _record(1, 1000, 500)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"label": "a", "hit_rate": bench.hit_rates(records)}))
    assert bench.table([path]).splitlines() == [
        "| server | prompt tokens | cached | overall | turn 0 | turn 1 |", "|---|---|---|---|---|---|",
        "| a | 2,000 | 500 | 25.0% | 0.0% | 50.0% |"]
