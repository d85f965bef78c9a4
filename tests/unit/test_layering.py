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
                  "hotprefix.core.kv_tiers", "hotprefix.model.runner", "hotprefix.model.families",
                  "hotprefix.model.layers", "hotprefix.model.steps", "hotprefix.model.attention",
                  "hotprefix.model.kernels", "hotprefix.engine.engine_loop")


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
    c_files = sorted((PKG / "model" / "kernels" / "csrc").glob("*.[ch]"))
    assert len(c_files) >= 8  # the kernels are where the map says (a rename would pass vacuously)
    long_c = [str(p.relative_to(PKG)) for p in c_files if len(p.read_text().splitlines()) > 500]
    long_files, long_functions = _over(sorted(PKG.rglob("*.py")), 500, 60)
    assert long_c + long_files == [] and long_functions == []


# -- the floors of the house: a module imports only from its own floor or below ----------------------
# (lowest first; a package names every module under it). The package itself, hotprefix/__init__.py,
# stands outside: it holds the version and hands users `LLM` lazily, and no module depends on the latter.
FLOORS = (
    ("errors", "flags", "config_json", "config", "server_config", "sampling_params", "sizing", "metric_names",
     "vllm_flags", "vllm_foreign", "vllm_foreign_model", "vllm_foreign_frontend"),
    ("core", "grammar", "grammar_build", "grammar_limits", "grammar_sandbox", "grammar_worker",
     "cachecurve"),
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
SHAPED = ("engine", "model")


def test_shaped_packages_have_no_file_over_400_lines_and_no_function_over_50():
    paths = [p for folder in SHAPED for p in sorted((PKG / folder).rglob("*.py"))]
    assert len(paths) >= 10
    assert _over(paths, 400, 50) == ([], [])


def test_only_the_kernels_package_calls_the_c_library():
    """model/kernels/ops.py wraps every C entry point: no tensor address and no `hp_`
    call anywhere else in the package (model/kernels/ holds the build, ABI and wrappers)."""
    kernels = PKG / "model" / "kernels"
    assert (kernels / "ops.py").is_file() and (kernels / "csrc" / "hp_api.h").is_file()
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if kernels in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "data_ptr(" in line or re.search(r"\.hp_\w+\(", line):
                offenders.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert offenders == []


# model/'s floors, lowest first: a module imports only from its own floor or below ("families" is the
# torch-free registry; its family modules sit above the layers they are made of)
MODEL_FLOORS = [("kernels", "kv_cache", "arch", "families", "gguf_file", "presets", "default_model", "weight_set",
                 "parallel"),
                ("attention", "layers", "gguf_loader", "weight_cache", "loader", "sampler", "scoring", "structured",
                 "drafts", "kv_offload", "lockstep"),
                ("families.*", "steps", "dummy"),
                ("build", "runner")]


def _model_floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["hotprefix", "model"] or len(parts) < 3:
        return None
    key = "families.*" if parts[2] == "families" and len(parts) > 3 else parts[2]
    return next((i for i, floor in enumerate(MODEL_FLOORS) if key in floor), None)


def test_model_imports_never_run_up_a_floor():
    """Kernels below attention backends and layers, those below step strategies, those
    below the runner (families' modules are imported by name from the registry)."""
    graph = {m: ts for m, ts in _import_graph().items() if _model_floor(m) is not None}
    offenders = [f"{m} imports {t}" for m, ts in sorted(graph.items()) for t in sorted(ts)
                 if _model_floor(t) is not None and _model_floor(t) > _model_floor(m)]
    assert len(graph) >= 30 and all(_model_floor(m) is not None for m in graph) and offenders == []


def _c_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each top-level C function definition."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(?:static\s+)?(?:inline\s+)?[\w\s\*]+?\b(\w+)\s*\([^;]*$", line)
        if m and not line.startswith((" ", "#", "/", "}")) and "=" not in line.split("(")[0]:
            j, depth, opened = i, 0, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                if opened and depth == 0:
                    break
                j += 1
            if opened:
                out.append((m.group(1), i + 1, j - i + 1))
    return out


def test_model_c_files_within_400_lines_and_functions_within_50():
    """model/'s C: files <= 400 lines, functions <= 50 (a SIMD kernel may run to 80 when a
    comment on the line before it says why: `/* long: ... */`)."""
    long_files, long_functions = [], []
    paths = sorted((PKG / "model" / "kernels" / "csrc").glob("*.[ch]"))
    assert len(paths) >= 8
    for path in paths:
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > 400:
            long_files.append(str(path.relative_to(PKG)))
        for name, first, n in _c_functions(text):
            allowed = 80 if first > 1 and "/* long:" in lines[first - 2] else 50
            if n > allowed:
                long_functions.append(f"{path.relative_to(PKG)}:{first} {name} ({n} lines)")
    assert long_files == [] and long_functions == []


def test_server_and_gateway_have_no_function_over_50_lines_and_no_file_over_400():
    """The HTTP layers keep the limits the map sets (docs/architecture.md), tighter than the
    package-wide ones above."""
    assert _over(_http_files(), 400, 50) == ([], [])
