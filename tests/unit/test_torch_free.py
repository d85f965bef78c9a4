"""The bookkeeping core never imports torch (docs/architecture.md: hotprefix/core is torch-free),
and neither does the gateway (it runs on machines without an accelerator stack)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import hotprefix.core
import hotprefix.gateway


def test_core_and_gateway_modules_import_without_torch():
    mods = ["hotprefix.config", "hotprefix.sizing", "hotprefix.sampling_params", "hotprefix.errors"] + [
        f"hotprefix.core.{m.name}" for m in pkgutil.iter_modules(hotprefix.core.__path__)] + [
        f"hotprefix.gateway.{m.name}" for m in pkgutil.iter_modules(hotprefix.gateway.__path__)
        if m.name != "migrations"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, bad\nprint(len(sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert len(mods) >= 9
