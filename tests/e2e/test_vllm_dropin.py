"""A vLLM user's launch line, metrics names, request fields and model defaults work
on hotprefix unchanged."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hotprefix import LLM, SamplingParams
from tests.server.conftest import launch_server, start_server, stop_process


def test_a_vllm_launch_line_and_vllm_metric_names(tiny_llama):
    proc, url = launch_server([str(tiny_llama[0]), "--max-model-len", "256", "--gpu-memory-utilization", "0.5",
                        "--enable-prompt-tokens-details", "--served-model-name", "a", "b", "--metrics-prefix",
                        "vllm", "-tp", "1", "--max-num-queued-reqs", "100", "--kv-cache-memory-bytes", "20000000",
                        "--uvicorn-log-level", "warning", "--root-path", "/api", "-v"])
    try:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["a", "b"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        system = {"role": "system", "content": "You answer questions about caching. " * 6}
        used = []
        for q in ("What is LRU?", "What is a hit?"):
            r = client.chat.completions.create(model="b", max_tokens=2, messages=[system, {"role": "user",
                                                                                          "content": q}])
            assert r.model == "b"
            used.append(r.usage.prompt_tokens_details.cached_tokens)
        assert used[0] == 0 and used[1] > 0
        text = httpx.get(url + "/metrics").text
        hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
        assert hits and float(hits[0].rsplit(" ", 1)[1]) == used[1]
        assert "vllm:kv_cache_usage_perc" in text and "hotprefix:" not in text
        assert httpx.get(url + "/openapi.json").json()["servers"] == [{"url": "/api"}]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt="x", max_tokens=1)
    finally:
        out = stop_process(proc)
    assert "serving a, b" in out


@pytest.mark.parametrize("args,needle", [
    (["-tp", "2"], "the model's 3 KV heads and 9 query heads do not split over 2 ranks"),  # the default model
    (["--model", "/no/such", "/other/path"], "two models given"),
    (["--allowed-origins", "[1, 2]"], "JSON list of strings"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be > 0, got 0.0"),
    (["--timeout-keep-alive", "nan"], "--timeout-keep-alive must be > 0, got nan"),
])
def test_launch_lines_hotprefix_cannot_honour_fail_with_one_line(tiny_llama, args, needle):
    r = subprocess.run([sys.executable, "-m", "hotprefix", "serve", *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_version_and_module_entry_point():
    import hotprefix

    script = str(Path(sys.executable).parent / "hotprefix")  # the console script beside this interpreter
    for cmd in ([sys.executable, "-m", "hotprefix", "--version"], [script, "--version"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"hotprefix {hotprefix.__version__}"
    h = subprocess.run([sys.executable, "-m", "hotprefix", "serve", "--help"], capture_output=True, text=True)
    assert "(default: 1024)" in h.stdout and "--metrics-prefix" in h.stdout


def test_https_with_a_self_signed_certificate(tiny_llama, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    trust = ssl.create_default_context(cafile=str(cert))
    proc, url = launch_server([str(tiny_llama[0]), "--max-model-len", "128", "--ssl-keyfile", str(key),
                               "--ssl-certfile", str(cert), "--disable-log-stats"], scheme="https", verify=trust)
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True},
                       verify=trust)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https", "http") + "/health", timeout=5)
    finally:
        stop_process(proc)


def with_generation_config(folder, tmp_path, cfg: dict):
    d = tmp_path / "model"
    shutil.copytree(folder, d)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def test_the_models_generation_config_gives_the_defaults(tiny_llama, tmp_path):
    d = with_generation_config(tiny_llama[0], tmp_path, {"temperature": 0.0, "top_k": 7, "max_new_tokens": 5,
                                                         "do_sample": True, "bos_token_id": 1})
    llm = LLM(model=str(d), num_blocks_override=64)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=7, max_tokens=5)
    assert LLM(model=str(d), num_blocks_override=64, generation_config="vllm").get_default_sampling_params() \
        == SamplingParams()
    s = start_server(d, max_model_len=128)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        a, b = (httpx.post(s.v1 + "/chat/completions", json=body).json() for _ in range(2))
        assert a["usage"]["completion_tokens"] == 5  # max_new_tokens
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]  # temperature 0
        hot = httpx.post(s.v1 + "/chat/completions", json={**body, "temperature": 1.5, "seed": 3, "max_tokens": 9})
        assert hot.json()["usage"]["completion_tokens"] == 9  # the request's own values win
    finally:
        s.stop()


def test_harmless_fields_are_accepted_and_template_kwargs_and_truncation_are_honoured(tiny_llama):
    template = ("{% for m in messages %}{{ m['content'] | upper if shout else m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    s = start_server(tiny_llama[0], server_kw={"chat_template": template}, max_model_len=128)
    offline = LLM(model=str(tiny_llama[0]), num_blocks_override=64)
    try:
        msgs = [{"role": "user", "content": "caching keys"}]
        tok = offline.tokenizer
        plain = httpx.post(s.url + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"shout": False}})
        loud = httpx.post(s.url + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"shout": True}})
        assert tok.decode(plain.json()["tokens"]) == "caching keys\n>"
        assert tok.decode(loud.json()["tokens"]) == "CACHING KEYS\n>"
        r = httpx.post(s.v1 + "/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                         "chat_template_kwargs": {"shout": True}})
        assert r.json()["usage"]["prompt_tokens"] == loud.json()["count"]
        bad = httpx.post(s.v1 + "/chat/completions", json={"messages": msgs, "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
        ok = httpx.post(s.v1 + "/chat/completions", json={
            "messages": msgs, "max_tokens": 1, "metadata": {"team": "x"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "u1", "user": "u1"})
        assert ok.status_code == 200
        ok = httpx.post(s.v1 + "/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                          "reasoning_effort": "high"})
        assert ok.status_code == 200  # no model here reasons: it cannot change a result
        refused = httpx.post(s.v1 + "/chat/completions", json={"messages": msgs, "audio": {"voice": "alloy"}})
        assert refused.status_code == 400 and "audio" in refused.json()["error"]["message"]
        ids = list(range(20, 40))
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        cut = httpx.post(s.v1 + "/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True, "truncate_prompt_tokens": 5}).json()
        assert cut["usage"]["prompt_tokens"] == 5
        assert cut["choices"][0]["text"] == offline.generate([ids[-5:]], sp)[0].outputs[0].text
        bad = httpx.post(s.v1 + "/completions", json={"prompt": ids, "truncate_prompt_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    finally:
        s.stop()


def test_cors_only_when_asked_and_the_stats_line(tiny_llama):
    s = start_server(tiny_llama[0], server_kw={"allowed_origins": ("https://app.example",), "api_key": "sk-k"},
                     max_model_len=128)
    plain = start_server(tiny_llama[0], max_model_len=128)
    try:
        pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        r = httpx.options(s.v1 + "/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in httpx.options(plain.v1 + "/completions", headers=pre).headers
        from hotprefix.server.stats_log import StatsLogger

        stats = StatsLogger(plain.async_engine)
        assert stats.line() is None  # idle: nothing to say
        httpx.post(plain.v1 + "/completions", json={"prompt": "hello there", "max_tokens": 3, "ignore_eos": True})
        plain.wait_idle()
        line = stats.line()
        assert line.startswith("Avg prompt throughput: ") and "Running: 0 reqs, Waiting: 0 reqs" in line
        assert "Prefix cache hit rate: 0.0%" in line
    finally:
        s.stop()
        plain.stop()


def _get_twice_on_one_connection(url: str, idle_s: float) -> tuple[int, bytes]:
    """GET /health, wait idle_s, GET again on the same socket: the second status line's
    code (0 when the server had closed the connection) and what came back."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(req)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        time.sleep(idle_s)
        try:
            s.sendall(req)
            second = s.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            second = b""
    return (int(second.split(b" ")[1]) if second.startswith(b"HTTP/1.1") else 0), second


def test_idle_keep_alive_connections_outlive_the_clients_expiry(tiny_llama):
    """The server keeps an idle connection longer (--timeout-keep-alive, 65 s) than
    httpx and the openai client do (5 s), so the client always closes first: with
    uvicorn's own 5 s, a request sent as the server closed its connection failed."""
    proc, url = launch_server([str(tiny_llama[0]), "--max-model-len", "256"])
    try:
        assert _get_twice_on_one_connection(url, 6.0)[0] == 200
    finally:
        stop_process(proc)
    proc, url = launch_server([str(tiny_llama[0]), "--max-model-len", "256", "--timeout-keep-alive", "1"])
    try:
        assert _get_twice_on_one_connection(url, 3.0) == (0, b"")  # closed by the server: the flag is honoured
    finally:
        stop_process(proc)


GUARDLESS_SCRIPT = '''
import json
from hotprefix import LLM, SamplingParams
from hotprefix.sampling_params import StructuredKind, StructuredOutput

schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
llm = LLM(kv_cache_memory="256MiB")
params = SamplingParams(temperature=0, max_tokens=24,
                        structured=StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema)))
out = llm.generate(["A number between 0 and 99 as JSON: "], params)[0].outputs[0]
print(json.dumps({"text": out.text, "finish_reason": out.finish_reason}))
'''


@pytest.mark.slow
def test_a_script_without_a_main_guard_gets_its_structured_output(tmp_path):
    """A vLLM user's script builds its LLM at top level (no `if __name__ == "__main__":`):
    the grammar compiler's worker process must not run the script again (it did under
    multiprocessing's spawn, and the script waited for it forever)."""
    script = tmp_path / "guardless.py"
    script.write_text(GUARDLESS_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    value = json.loads(result["text"])
    assert result["finish_reason"] == "stop" and list(value) == ["n"] and isinstance(value["n"], int)
    assert 0 <= value["n"] <= 99
