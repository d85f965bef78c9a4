"""benchmarks/spec_http.py's pure parts: reading a streamed chat completion (hotprefix's
usage, llama-server's timings), the decode rate, CPU ticks from /proc/PID/stat, the
spec_decode counters from a metrics page, the medians and the token match; and
spec_prompts' document cut."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))  # the script and its neighbours
import spec_http as bench  # noqa: E402
import spec_prompts  # noqa: E402


def sse(*chunks: dict) -> list[str]:
    return [f"data: {json.dumps(c)}" for c in chunks] + ["", "data: [DONE]"]


def delta(text: str | None = None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}]}


def test_stream_times_first_and_last_content_and_takes_the_usage_count():
    lines = sse(delta(""), delta("Hello"), delta(" wor"), delta("ld", "length"),
                {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    times = [0.1, 0.5, 0.7, 1.3, 1.4, 1.5, 1.6]
    s = bench.read_stream(zip(times, lines))
    assert (s.first_s, s.last_s, s.tokens, s.text) == (0.5, 1.3, 4, "Hello world")
    assert (s.finish_reason, s.timings) == ("length", {})
    assert bench.decode_rate(s) == pytest.approx(3 / 0.8)


def test_stream_without_usage_counts_content_chunks_and_keeps_llamaserver_timings():
    timings = {"predicted_n": 3, "draft_n": 12, "draft_n_accepted": 7}
    lines = sse(delta("a"), delta("b"), {**delta("c", "length"), "timings": timings})
    s = bench.read_stream(zip([1.0, 2.0, 3.0, 3.5, 4.0], lines))
    assert (s.tokens, s.text, s.timings) == (3, "abc", timings)
    assert bench.decode_rate(s) == pytest.approx(1.0)


def test_no_decode_rate_without_an_interval():
    assert bench.decode_rate(bench.Stream(None, None, 0, "", None)) is None
    assert bench.decode_rate(bench.Stream(0.5, 0.5, 1, "a", "length")) is None


def test_cpu_ticks_counts_fields_after_the_last_parenthesis():
    stat = "4242 (llama (srv) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 731 96 5 7 20 0 3 0 12345 0 0"
    assert bench.cpu_ticks(stat) == 731 + 96


def test_tree_cpu_of_this_process_grows_and_of_a_missing_pid_raises():
    assert bench.tree_cpu_s(1) >= 0.0
    with pytest.raises(OSError):
        bench.tree_cpu_s(2 ** 22 + 1)  # above the kernel's largest pid


def test_spec_counters_sum_label_sets_and_ignore_other_names():
    page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total drafts",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{model_name="m"} 18.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 68.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 60.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 17.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="n"} 4.0',
        'vllm:num_requests_running{model_name="m"} 1.0', ""])
    assert bench.spec_counters(page) == (18.0, 68.0, 64.0)
    assert bench.spec_counters("vllm:num_requests_running 0\n") == (0.0, 0.0, 0.0)


def test_body_constrains_json_and_ignores_eos_elsewhere():
    msgs = [{"role": "user", "content": "x"}]
    free = bench.body(msgs, None, "m")
    assert (free["ignore_eos"], free["max_tokens"], free["temperature"], free["stream"]) == (True, 96, 0.0, True)
    assert "response_format" not in free
    schema = {"type": "object"}
    constrained = bench.body(msgs, schema, "m")
    assert "ignore_eos" not in constrained
    assert constrained["response_format"] == {"type": "json_schema", "json_schema": {"name": "extraction",
                                                                                     "schema": schema}}


def sample(config: str, workload: str, rnd: int, tps: float | None, text: str, accepted: float | None = None) -> dict:
    return {"config": config, "workload": workload, "round": rnd, "tokens": 96, "decode_tps": tps,
            "request_tps": 50.0, "cpu_ms_per_token": 10.0 + rnd, "drafts": None,
            "draft_tokens": 8.0 if accepted else None,
            "accepted": accepted, "finish_reason": "length", "load1": 1.0, "text": text}


def test_summary_medians_last_drafts_and_match_against_the_first_config():
    samples = [sample("off", "quote", r, tps, "a b c") for r, tps in enumerate((100.0, 300.0, 200.0))]
    samples += [sample("llama", "quote", r, tps, "a b x" if r == 2 else "a b c", accepted=r + 1.0)
                for r, tps in enumerate((150.0, None, 250.0))]
    got = bench.summarise(samples, tokenize=str.split)["quote"]
    assert got["off"] == {"decode_tps": 200.0, "request_tps": 50.0, "cpu_ms_per_token": 11.0, "tokens": [96],
                          "same_text": True, "drafts": None, "draft_tokens": None, "accepted": None, "rounds": 3,
                          "match": 3}
    assert got["llama"]["decode_tps"] == 200.0 and got["llama"]["accepted"] == 3.0
    assert (got["llama"]["same_text"], got["llama"]["match"]) == (False, 2)
    md = bench.table(bench.summarise(samples, tokenize=str.split), spec_label="off").splitlines()
    assert md[2] == "| off | 200.0; 11.0; -; 3/96 match |"
    assert md[3] == "| llama | 200.0; 11.0; 3/8; 2/96 match |"
    assert md[4] == "| off / best llama-server | **1.00x** (llama) |"


def test_document_stops_before_the_paragraph_that_passes_the_budget():
    text = "one two\n\nthree four five\n\nsix"
    assert spec_prompts.document(4, str.split, text) == "one two\n\n"
    assert spec_prompts.document(5, str.split, text) == "one two\n\nthree four five\n\n"
    assert spec_prompts.document(6, str.split, text) == text + "\n\n"
    assert set(spec_prompts.prompts(str.split)) == set(spec_prompts.WORKLOADS)
