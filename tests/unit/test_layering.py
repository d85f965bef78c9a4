"""The rules of docs/architecture.md that code can check: HTTP handlers reach the
engine only through AsyncEngine's facade (never its LLMEngine, scheduler, KV manager
or runner, which belong to the engine thread), and nothing in the package shows the
shapes the map rules out (a Python function over 60 lines, a Python or C file over 500)."""

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
                  "hotprefix.model.fused_decode", "hotprefix.engine.engine_loop")


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


def test_no_function_over_60_lines_and_no_file_over_500():
    c_files = sorted((PKG / "model" / "csrc").glob("*.[ch]"))
    assert len(c_files) >= 8  # the kernels are where the map says (a rename would pass vacuously)
    long_files = [str(p.relative_to(PKG)) for p in c_files if len(p.read_text().splitlines()) > 500]
    long_functions = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_files.append(str(path.relative_to(PKG)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
    assert long_files == [] and long_functions == []


# -- the floors of the house: a module imports only from its own floor or below ----------------------
# (lowest first; a package names every module under it). The package itself, hotprefix/__init__.py,
# stands outside: it holds the version and hands users `LLM` lazily, and no module depends on the latter.
FLOORS = (
    ("errors", "config", "sampling_params", "sizing", "metric_names", "vllm_flags"),
    ("core", "grammar", "grammar_build", "grammar_limits", "grammar_sandbox"),
    ("tokenizers",),
    ("model",),
    ("engine",),
    ("server",),
    ("gateway", "tools", "cli", "__main__"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports, anywhere in it
    (function-level and TYPE_CHECKING imports count: they are dependencies too)."""
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "hotprefix"}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: a relative import"
                if (node.module or "").split(".")[0] == "hotprefix":  # `from pkg import module` names the module
                    targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                                for a in node.names}
        graph[name] = targets - {name}
    assert len(graph) >= 100 and all(t in paths for ts in graph.values() for t in ts)
    return graph


def _floor(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, floor in enumerate(FLOORS) if top in floor)


def test_every_module_has_a_floor():
    tops = {m.split(".")[1] for m in _import_graph() if m != "hotprefix"}
    assert tops - {top for floor in FLOORS for top in floor} == set()


def test_no_import_runs_up_a_floor():
    upward = [f"{m} (floor {_floor(m)}) -> {t} (floor {_floor(t)})"
              for m, targets in sorted(_import_graph().items()) if m != "hotprefix"
              for t in sorted(targets) if t != "hotprefix" and _floor(t) > _floor(m)]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = stack[stack.index(v):]
                del stack[stack.index(v):]
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_two_modules_import_each_other():
    assert _cycles(_import_graph()) == []


# packages held to the map's shapes: files of at most 400 lines, functions of at most 50
SHAPED = ("engine",)


def test_shaped_packages_have_no_file_over_400_lines_and_no_function_over_50():
    paths = [p for folder in SHAPED for p in sorted((PKG / folder).rglob("*.py"))]
    assert len(paths) >= 10
    long_files, long_functions = [], []
    for path in paths:
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_files.append(str(path.relative_to(PKG)))
        long_functions += [f"{path.relative_to(PKG)}:{node.lineno} {node.name}" for node in ast.walk(ast.parse(text))
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and node.end_lineno - node.lineno >= 50]
    assert long_files == [] and long_functions == []
