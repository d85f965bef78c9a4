"""`vllm serve` launch lines work with `hotprefix serve`: every flag such lines commonly
carry is honoured, or accepted and named at start-up as having no effect (with why), or
refused when it would change results; `--config FILE` as vLLM reads it."""

from __future__ import annotations

import argparse

import httpx
import pytest

from hotprefix.cli import build_parser, engine_config_from_args, main, serve_flags
from hotprefix.config import ConfigError
from hotprefix.vllm_flags import FOREIGN_FLAGS, check_foreign, expand_config, human_int
from tests.server.conftest import launch_server, stop_process

# the flags of issue 28's list, as launch lines carry them
LINE = ["--disable-log-requests", "--enable-log-requests", "--trust-remote-code", "--enforce-eager",
        "--max-logprobs", "5", "--quantization", "gguf", "--tokenizer-mode", "auto", "--download-dir", "/tmp/hf",
        "--disable-fastapi-docs", "--pipeline-parallel-size", "1", "--calculate-kv-scales", "-O3",
        "--response-role", "assistant", "--return-tokens-as-token-ids", "--enable-lora",
        "--structured-outputs-config.backend", "xgrammar", "--guided-decoding-backend", "auto",
        "--dtype", "half", "--max-model-len", "4k", "--tool-call-parser", "llama3_json",
        "--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--disable-uvicorn-access-log"]


def named_in(line: list[str]) -> set[str]:
    """The foreign flags a line gives (by the name start-up uses), --lora-modules aside (refused)."""
    given = {n for x in line for n in (x, x[:2])}  # (-O3 is -O)
    return {d.names[-1] for d in FOREIGN_FLAGS if given & {*d.names, *d.off_names}} - {"--lora-modules"}


def parse(args: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(expand_config(["serve", *args], serve_flags(parser)))


def test_the_whole_list_parses_and_each_flag_lands_or_is_named():
    a = parse(LINE)
    cfg = engine_config_from_args(a)
    assert cfg.model.max_model_len == 4000 and cfg.model.dtype == "float16" and cfg.model.download_dir == "/tmp/hf"
    assert cfg.model.enforce_eager
    assert (a.max_logprobs, a.return_tokens_as_token_ids, a.disable_fastapi_docs, a.tool_call_parser) == \
        (5, True, True, "llama3_json")
    lines = check_foreign(a)
    assert {line.split(":")[0].split(" ")[0] for line in lines} == named_in(LINE)
    assert all("accepted, no effect here (" in line for line in lines)


@pytest.mark.parametrize("args,why", [
    (["--quantization", "awq"], "only GGUF block weights"),
    (["-pp", "2"], "one engine per device"),
    (["--lora-modules", "sql=/adapters/sql"], "LoRA adapters are not supported"),
    (["--tokenizer-mode", "mistral"], "tekken"),
    (["--response-role", "user"], "assistant"),
])
def test_values_that_would_change_results_are_refused_with_why(args, why, capsys):
    with pytest.raises(ConfigError, match=why):
        check_foreign(parse(args))
    assert main(["serve", *args]) == 2 and why in capsys.readouterr().err


def test_gpu_path_flags_land_in_the_config():
    cfg = engine_config_from_args(parse(["--load-format", "dummy", "--attention-backend", "triton",
                                         "--cuda-graph-sizes", "1", "2", "8"]))
    assert (cfg.model.load_format.value, cfg.model.attention_backend.value, cfg.model.cuda_graph_sizes,
            cfg.model.enforce_eager) == ("dummy", "triton", (1, 2, 8), False)
    for spelled in (["1,2,8"], ["[1, 2, 8]"]):
        assert engine_config_from_args(parse(["--cuda-graph-sizes", *spelled])).model.cuda_graph_sizes == (1, 2, 8)
    for bad in (["x"], ["0"], ["5000"]):
        with pytest.raises(ConfigError, match="--cuda-graph-sizes"):
            engine_config_from_args(parse(["--cuda-graph-sizes", *bad]))


@pytest.mark.parametrize("text,value", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600),
                                        ("1m", 1_000_000), ("1M", 1 << 20), ("2g", 2 * 10**9)])
def test_human_readable_integers(text, value):
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["4x", "", "-1", "1.5", "k"])
def test_not_integers(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int(text)


def test_a_config_file_as_vllm_reads_it(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("model: /models/x.gguf\nmax-model-len: 2k\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
                 "disable-log-stats: true\nserved-model-name: [a, b]\nport: 9000\n")
    a = parse(["--config", str(f), "--max-num-seqs", "4"])  # the command line wins
    assert (a.model, a.max_model_len, a.max_num_seqs, a.enable_prefix_caching, a.disable_log_stats,
            a.served_model_name, a.port) == ("/models/x.gguf", 2000, 4, False, True, ["a", "b"], 9000)
    assert parse([f"--config={f}"]).max_num_seqs == 8
    f.write_text("max-model-length: 10\n")
    assert main(["serve", "--config", str(f)]) == 2 and "'max-model-length' is not a flag" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_a_server_started_with_the_whole_list(tiny_llama):
    line = [x for x in LINE if x not in ("half",)]  # (float16 on CPU works, but slowly: float32 here)
    line[line.index("--dtype") + 1:line.index("--dtype") + 1] = ["float32"]
    line[line.index("4k")] = "256"
    proc, url = launch_server([str(tiny_llama[0]), *line])
    try:
        assert httpx.get(url + "/docs").status_code == 404 and httpx.get(url + "/openapi.json").status_code == 404
        body = {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "ignore_eos": True, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert all(t.startswith("token_id:") and int(t[9:]) >= 0 for t in lp["tokens"])
        too_many = httpx.post(url + "/v1/completions", json={**body, "logprobs": 6})
        assert too_many.status_code == 400 and "--max-logprobs" in too_many.json()["error"]["message"]
    finally:
        out = stop_process(proc)
    for name in named_in(line):
        assert f"{name}" in out and "accepted, no effect here" in out, name
    assert "--enforce-eager: accepted, no effect here (CUDA graphs are captured on CUDA only" in out  # (a CPU)
