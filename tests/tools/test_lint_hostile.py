"""`hotprefix lint` on hostile inputs: each file of the attack (a size no server has, deep
nesting, a 5,000-digit integer, bytes that are not UTF-8, bodies of the wrong types, a
100 MB line, a million rows) ends in one line naming the line, exit 2, with the lint
process's peak memory under 500 MB (its own, from the kernel: wait4's rusage); and
`lint --url` against a server whose answers are broken or carry terminal escapes says
one line, or prints the answer escaped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from hotprefix.server.request_log import KVShape, LogRow, LogStatus, PrefixEntry
from tests.server.conftest import serve_in_thread

PEAK_BYTES = 500 << 20
ROW = LogRow(1.0, "r", "completions", "m", None, LogStatus.OK, 20, 0, 1, 0.1, 0.2, "length", KVShape(16, 256, 0),
             (PrefixEntry(20, 0, 1, ("ab" * 16,)),)).to_json()


# Started by a small process of its own: a child's peak RSS counts the image it was forked
# from (this test process's) until it runs the new program.
MEASURE = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def lint(*args: str, tmp: Path) -> tuple[int, str, str, int]:
    """`python -m hotprefix lint ARGS`: (exit code, stdout, stderr, its peak RSS in bytes)."""
    peak = tmp / "peak"
    r = subprocess.run([sys.executable, "-c", MEASURE, str(peak), sys.executable, "-m", "hotprefix", "lint", *args],
                       capture_output=True)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"), int(peak.read_text())


def write_rows(path: Path, line: str, n: int) -> None:
    with path.open("w") as f:
        for _ in range(n // 10_000):
            f.write(line * 10_000)


def write_long_line(path: Path, mib: int) -> None:
    """One body whose prompt is `mib` MiB, written a MiB at a time."""
    with path.open("w") as f:
        f.write('{"prompt": "')
        for _ in range(mib):
            f.write("a" * (1 << 20))
        f.write('"}\n')


def _kv(**kv: int) -> str:
    return json.dumps(ROW | {"kv": {"block_size": 16, "blocks": 256, **kv}}) + "\n"


HOSTILE = {  # name: (the file's content or a writer, what its one line must say)
    "kv-blocks": (_kv(blocks=1_000_000_000), "kv.blocks must be at most 16777216"),
    "kv-blocks-float": (json.dumps(ROW).replace('"blocks": 256', '"blocks": 1e9') + "\n",
                        "kv.blocks must be an integer >= 1, got 1000000000.0"),
    "host-blocks": (_kv(host_blocks=1_000_000_000), "kv.host_blocks must be at most 16777216"),
    "block-size": (_kv(block_size=1 << 20), "kv.block_size must be at most 1024"),
    "tokens": (json.dumps(ROW | {"prefix": [{"tokens": 10**12, "blocks": []}]}) + "\n",
               "prefix[0].tokens must be at most 16777216"),
    "deep-nesting": ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "nests deeper than 64 levels"),
    "5000-digits": ('{"prompt": [' + "7" * 5000 + "]}\n", "Exceeds the limit (4300 digits)"),
    "not-utf8": (b'{"prompt": "caf\xe9"}\n', "'utf-8' codec can't decode byte 0xe9"),
    "nan": ('{"prefix": [], "time": NaN}\n', "NaN is not a JSON number"),
    "content-not-text": ('{"messages": [{"role": "user", "content": 5}]}\n',
                         "a request body whose messages[0].content must be text"),
    "messages-not-a-list": ('{"messages": {"role": "user"}}\n', "`messages` must be a non-empty list"),
    "prompt-an-object": ('{"prompt": {"a": 1}}\n', "`prompt` must be text or a list of token ids"),
    "salt-offset-huge": ('{"prompt": "x", "cache_salt": "s", "cache_salt_offset": 99999999999}\n',
                         "`cache_salt_offset` a token count"),
    "100MB-line": (lambda p: write_long_line(p, 100),
                   ":1: a line longer than 4194304 bytes (--max-line-bytes)"),
    "million-rows": (lambda p: write_rows(p, '{"prompt": "x"}\n', 1_000_000),
                     ":100001: more than 100000 rows (--max-rows)"),
    "rows-of-the-log": (lambda p: write_rows(p, json.dumps(ROW) + "\n", 110_000),
                        ":100001: more than 100000 rows (--max-rows)"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_file_is_one_line_within_500_mb(name, tmp_path):
    content, said = HOSTILE[name]
    path = tmp_path / f"{name}.jsonl"
    if callable(content):
        content(path)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err, peak = lint(str(path), tmp=tmp_path)
    assert code == 2 and out == "", (code, out, err[-2000:])
    (line,) = err.splitlines()  # one line, no traceback
    assert line.startswith(f"hotprefix: error: {path}:") and said in line, line
    assert peak < PEAK_BYTES, f"{name}: peak RSS {peak >> 20} MiB"


# -- lint --url against a hostile server ---------------------------------------------------------------

ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31m"


def hostile_server() -> FastAPI:
    app = FastAPI()
    answers = {
        "garbage": lambda: PlainTextResponse("<html>not json</html>"),
        "shape": lambda: JSONResponse({"requests": "many", "groups": 5}),
        "group-shape": lambda: JSONResponse({"requests": 1, "block_size": 16, "groups": [{"group": 1}]}),
        "error": lambda: JSONResponse({"error": {"message": f"go away{ESC}\nforged: line"}}, status_code=500),
        "escapes": lambda: JSONResponse({"requests": 2, "block_size": 16, "groups": [
            {"group": f"ab{ESC}\nFAKE LINE", "requests": 2, "hit_rate": 0.5, "possible_hit_rate": 0.5,
             "breaks": [{"token": 16, "requests": 1}]}]}),
        "endless": lambda: StreamingResponse(iter([b"x" * (1 << 20)] * 64), media_type="application/json"),
        "deep": lambda: Response("[" * 100_000, media_type="application/json"),
    }

    @app.get("/{kind}/prefix_groups")
    async def groups(kind: str):
        return answers[kind]()

    return app


@pytest.fixture(scope="module")
def hostile_url():
    url, server, thread = serve_in_thread(hostile_server())
    yield url
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize(("kind", "said"), [
    ("garbage", "answered something that is not its prefix groups: it must be an object with integer `requests`"),
    ("shape", "answered something that is not its prefix groups"),
    ("group-shape", "groups[0] must have a string `group`"),
    ("error", "answered 500: go away\\x1b]0;owned\\x07\\x1b[2J\\x1b[31m\\nforged: line"),
    ("endless", "answered more than 33554432 bytes"),
    ("deep", "answered something that is not its prefix groups"),
])
def test_lint_url_says_one_line_of_a_broken_answer(hostile_url, kind, said, tmp_path):
    code, out, err, _ = lint("--url", f"{hostile_url}/{kind}", tmp=tmp_path)
    assert code == 2 and out == "", (code, out, err[-2000:])
    (line,) = err.splitlines()
    assert line.startswith("hotprefix: error: ") and said in line, line
    assert "\x1b" not in err and "\x07" not in err


@pytest.mark.parametrize("as_json", [False, True])
def test_lint_url_prints_a_servers_escapes_escaped(hostile_url, as_json, tmp_path):
    code, out, err, _ = lint("--url", f"{hostile_url}/escapes", *(["--json"] if as_json else []), tmp=tmp_path)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "FAKE LINE" in out
    if as_json:
        assert json.loads(out)["groups"][0]["group"] == f"ab{ESC}\nFAKE LINE"  # the value, whole, as JSON
    else:
        (row,) = [ln for ln in out.splitlines() if "FAKE LINE" in ln]  # the name's line break stays escaped
        assert row.startswith("  ab\\x1b]0;owned\\x07") and "\\nFAKE LINE" in row
