"""`hotprefix generate` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hotprefix import LLM, SamplingParams


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotprefix.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_generate_json_matches_the_offline_api(tiny_llama):
    folder = str(tiny_llama[0])
    r = run_cli("generate", "--model", folder, "--num-gpu-blocks-override", "64", "--temperature", "0",
                "--max-tokens", "6", "--ignore-eos", "--json", "hello world", "caching")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    ref = LLM(model=folder, num_blocks_override=64).generate(
        ["hello world", "caching"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [row["token_ids"] for row in rows] == [o.outputs[0].token_ids for o in ref]
    assert [row["finish_reason"] for row in rows] == ["length", "length"]
    assert "KV pool:" in r.stderr  # start-up reports the pool it sized


def test_generate_reads_stdin_and_applies_chat(tiny_llama):
    r = run_cli("generate", "--model", str(tiny_llama[0]), "--num-gpu-blocks-override", "64", "--chat",
                "--temperature", "0", "--max-tokens", "3", "--json", stdin="hi")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt"].startswith("<|im_start|>user\nhi")


@pytest.mark.parametrize("args,msg", [
    (["--model", "/no/such/model"], "hotprefix: error: model path does not exist: /no/such/model"),
    (["--kv-cache-memory", "lots"],
     "hotprefix: error: cannot parse memory size 'lots' (examples: 4GiB, 512MB, 1000000)"),
    (["--block-size", "0"], "hotprefix: error: --block-size must be in 1..1024, got 0"),
    (["--temperature", "-1"], "hotprefix: error: temperature must be >= 0, got -1.0"),
])
def test_bad_input_is_one_line_not_a_traceback(args, msg):
    r = run_cli("generate", *args, "x")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == msg
    assert "Traceback" not in r.stderr
