"""Model resolution and loading errors: one line naming what was wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hotprefix import LLM
from hotprefix.model.arch import ModelLoadError
from hotprefix.model.loader import default_model_path, load_model, resolve_model
from tests.conftest import build_tiny_model


def one_line_error(model: str | None, build: bool = False) -> str:
    """The error of loading (and with build=True, constructing an engine on) model."""
    with pytest.raises(ModelLoadError) as e:
        LLM(model=model, num_blocks_override=4) if build else load_model(model)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_missing_path(tmp_path):
    assert "does not exist" in one_line_error(str(tmp_path / "nope"))
    assert "does not exist" in one_line_error(str(tmp_path / "model.gguf"))


def test_unknown_architecture(tmp_path, tiny_llama):
    folder, _ = tiny_llama
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    assert "unsupported architecture ['GPT2LMHeadModel']" in one_line_error(str(d))


def test_unsupported_rope_scaling(tmp_path, tiny_llama):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama[0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    assert "unsupported rope scaling type 'yarn'" in one_line_error(str(d))


def test_folder_without_config_or_weights(tmp_path, tiny_llama):
    (tmp_path / "empty").mkdir()
    assert "no config.json" in one_line_error(str(tmp_path / "empty"))
    d = tmp_path / "noweights"
    shutil.copytree(tiny_llama[0], d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    assert "no .safetensors weights" in one_line_error(str(d))


def test_missing_shard(tmp_path):
    build_tiny_model(tmp_path, "llama", max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert f"shard {shard.name} named in the index is missing" in one_line_error(str(tmp_path))


def test_weights_that_do_not_match_the_config(tmp_path, tiny_llama):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama[0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    assert "missing ['model.layers.2." in one_line_error(str(d), build=True)
    cfg["num_hidden_layers"], cfg["hidden_size"] = 2, 96
    (d / "config.json").write_text(json.dumps(cfg))
    assert "has shape (320, 64), the config implies (320, 96)" in one_line_error(str(d), build=True)


def test_unsupported_activation(tmp_path, tiny_llama):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama[0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (d / "config.json").write_text(json.dumps(cfg))
    assert "unsupported hidden_act 'gelu'" in one_line_error(str(d))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert "not a readable GGUF file" in one_line_error(str(bad))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"x")
    assert "must be .gguf" in one_line_error(str(txt))


def test_default_model_is_found_without_importing_its_package():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model(None) == path


def test_hub_id_resolves_through_huggingface_hub_cache(tmp_path, tiny_llama, monkeypatch):
    """The hub code path, run offline against a local hub cache laid out as
    huggingface_hub lays out its downloads."""
    import huggingface_hub

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_llama[0], snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("tiny-org/tiny-llama")
    assert os.path.realpath(loaded.source) == os.path.realpath(snap)
    assert loaded.arch.family == "llama" and loaded.arch.num_layers == 2
    msg = one_line_error("tiny-org/not-there")
    assert msg.startswith("cannot download 'tiny-org/not-there' from the hub")
