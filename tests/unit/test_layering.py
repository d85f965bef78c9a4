"""The rules of docs/architecture.md that code can check: HTTP handlers reach the
engine only through AsyncEngine's facade (never its LLMEngine, scheduler, KV manager
or runner, which belong to the engine thread), and nothing in the package shows the
shapes the map rules out (a function over 60 lines, a file over 500)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hotprefix"
# what only the engine thread may touch, reached from an AsyncEngine
INTERNALS = re.compile(r"\bengine\.(engine|scheduler|kv|runner|encoder|tokenizer|_\w+)\b")


def test_http_layers_use_only_the_engine_facade():
    offenders = []
    for folder in ("server", "gateway"):
        for path in sorted((PKG / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if INTERNALS.search(line):
                    offenders.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert offenders == []


def test_no_function_over_60_lines_and_no_file_over_500():
    long_functions, long_files = [], []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_files.append(str(path.relative_to(PKG)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
    assert long_files == [] and long_functions == []
