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
                  "hotprefix.core.kv_tiers", "hotprefix.model.runner", "hotprefix.model.families",
                  "hotprefix.model.layers", "hotprefix.model.steps", "hotprefix.model.attention",
                  "hotprefix.model.kernels")


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
    c_files = sorted((PKG / "model" / "kernels" / "csrc").glob("*.[ch]"))
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


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                      if _is_module(f"{node.module}.{a.name}")]
    return names


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "hotprefix":
        return False
    base = PKG.joinpath(*parts[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


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
MODEL_FLOORS = [("kernels", "kv_cache", "arch", "families", "gguf_file", "presets", "default_model", "weight_set"),
                ("attention", "layers", "gguf_loader", "weight_cache", "loader", "sampler", "structured",
                 "kv_offload"),
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
    offenders = []
    files = sorted((PKG / "model").rglob("*.py"))
    for path in files:
        mod = "hotprefix." + ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        own = _model_floor(mod)
        if own is None:
            continue
        for name in _imports(path):
            other = _model_floor(name)
            if other is not None and other > own:
                offenders.append(f"{mod} imports {name}")
    assert len(files) >= 30 and offenders == []


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


def test_model_files_within_400_lines_and_functions_within_50():
    """model/: Python and C files <= 400 lines, functions <= 50 (a SIMD kernel may run to
    80 when a comment on the line before it says why: `/* long: ... */`)."""
    long_files, long_functions = [], []
    for path in sorted((PKG / "model").rglob("*")):
        if path.suffix not in (".py", ".c", ".h"):
            continue
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_files.append(str(path.relative_to(PKG)))
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                    long_functions.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
            continue
        lines = text.splitlines()
        for name, first, n in _c_functions(text):
            allowed = 80 if first > 1 and "/* long:" in lines[first - 2] else 50
            if n > allowed:
                long_functions.append(f"{path.relative_to(PKG)}:{first} {name} ({n} lines)")
    assert long_files == [] and long_functions == []
