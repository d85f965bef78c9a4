"""The rules of docs/architecture.md that code can check: HTTP handlers reach the
engine only through AsyncEngine's facade (never its LLMEngine, scheduler, KV manager
or runner, which belong to the engine thread), and nothing in the package shows the
shapes the map rules out (a Python function over 60 lines, a Python or C file over 500;
in server/ and gateway/, a function over 50 lines or a file over 400)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hotprefix"
# what only the engine thread may touch, reached from an AsyncEngine
INTERNALS = re.compile(r"\bengine\.(engine|scheduler|kv|runner|encoder|tokenizer|_\w+)\b")


# the engine thread's modules: HTTP code never imports them (AsyncEngine keeps its LLMEngine private,
# and ruff's SLF001 refuses private members across modules)
THREAD_MODULES = ("hotprefix.core.scheduler", "hotprefix.core.kv_cache_manager", "hotprefix.core.block_pool",
                  "hotprefix.core.kv_tiers", "hotprefix.model.runner", "hotprefix.model.llama",
                  "hotprefix.model.fused_decode")


def _http_files() -> list[Path]:
    files = [p for folder in ("server", "gateway") for p in sorted((PKG / folder).rglob("*.py"))]
    assert len(files) >= 25  # the folders are where the map says (a rename would pass vacuously)
    return files


def test_http_layers_use_only_the_engine_facade():
    offenders = []
    for path in _http_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if INTERNALS.search(line):
                offenders.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert offenders == []


def test_http_layers_import_no_engine_thread_module():
    offenders = []
    for path in _http_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(PKG)}: {n}" for n in names if n.startswith(THREAD_MODULES)]
    assert offenders == []


def _over(paths: list[Path], max_file_lines: int, max_function_lines: int) -> tuple[list[str], list[str]]:
    """(the Python files longer than max_file_lines, the functions longer than max_function_lines)."""
    long_files, long_functions = [], []
    for path in paths:
        text = path.read_text()
        if len(text.splitlines()) > max_file_lines:
            long_files.append(str(path.relative_to(PKG)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno >= max_function_lines:
                long_functions.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
    return long_files, long_functions


def test_no_function_over_60_lines_and_no_file_over_500():
    c_files = sorted((PKG / "model" / "csrc").glob("*.[ch]"))
    assert len(c_files) >= 8  # the kernels are where the map says (a rename would pass vacuously)
    long_c = [str(p.relative_to(PKG)) for p in c_files if len(p.read_text().splitlines()) > 500]
    long_files, long_functions = _over(sorted(PKG.rglob("*.py")), 500, 60)
    assert long_c + long_files == [] and long_functions == []


def test_server_and_gateway_have_no_function_over_50_lines_and_no_file_over_400():
    """The HTTP layers keep the limits the map sets (docs/architecture.md), tighter than the
    package-wide ones above."""
    assert _over(_http_files(), 400, 50) == ([], [])
