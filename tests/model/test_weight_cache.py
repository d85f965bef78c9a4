"""int8 mode's regrouped weights on disk (model/weight_cache.py): written once, mapped at
later starts, rebuilt when torn, tidied after killed writers, and never required."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch

from hotprefix.config import CacheConfig, ModelConfig, SchedulerConfig
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.model import weight_cache
from hotprefix.model.kernels.weights import PackedWeight
from hotprefix.model.loader import load_model
from hotprefix.model.runner import ModelRunner
from hotprefix.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.gguf_util import write_gguf

IDS = [(7 * i) % 300 + 3 for i in range(19)]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("wc")
    model = build_tiny_model(d / "src", "llama", seed=7, hidden_size=256, intermediate_size=384,
                             num_attention_heads=4, num_key_value_heads=2)
    return write_gguf(d / "tiny-Q4_K_M.gguf", model, AutoTokenizer.from_pretrained(str(d / "src")), "Q4_K_M")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTPREFIX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "regrouped"


def runner(path, settle: bool = True) -> ModelRunner:
    """A runner of the file in int8 mode; with `settle`, once its cache file is synced and in place."""
    r = ModelRunner(load_model(str(path)), ModelConfig(device="cpu", quantized_matmul="int8"),
                    CacheConfig(block_size=8, num_blocks_override=16), SchedulerConfig())
    if settle:
        weight_cache.settle()
    return r


def logits(r: ModelRunner) -> torch.Tensor:
    return r.all_logits(SchedulerOutput([ScheduledRequest("x", IDS, 0, list(range(16)), True, SamplingParams(),
                                                          IDS, [])]))


def named_int8_weights(r: ModelRunner) -> dict[str, PackedWeight]:
    out = {}
    for i, layer in enumerate(r.model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for names, w in ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), a.qkv_blocks),
                         (("mlp.gate_proj", "mlp.up_proj"), m.gate_up_blocks), (("self_attn.o_proj",), a.o_proj.blocks),
                         (("mlp.down_proj",), m.down_proj.blocks)):
            out.update({f"model.layers.{i}.{n}.weight": p for n, p in zip(names, w.parts)})
    return out | {"lm_head.weight": r.model.logits_blocks}


def int8_weights(r: ModelRunner) -> list[PackedWeight]:
    return list(named_int8_weights(r).values())


def test_first_start_writes_the_cache_and_later_starts_map_it(gguf_path, cache, monkeypatch):
    first = runner(gguf_path)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".bin"
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    want = logits(first)

    def refuse(*a, **k):
        raise AssertionError("regrouped again at a later start")

    monkeypatch.setattr(PackedWeight, "regrouped", refuse)
    second = runner(gguf_path)
    assert logits(second).equal(want)
    # every int8 weight is a view of the cache file's one map, at its offset in the index
    data = files[0].read_bytes()
    index = json.loads(data[16:16 + int.from_bytes(data[8:16], "little")])
    named = named_int8_weights(second)
    assert set(named) == set(index)
    assert {p.raw.data_ptr() - index[n][0] for n, p in named.items()} == {second.model.logits_blocks.raw.data_ptr()
                                                                          - index["lm_head.weight"][0]}
    assert all(p.int8 and p.raw.numel() == index[n][1] for n, p in named.items())
    types = {p.type_name for p in int8_weights(second)}
    assert types == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}  # Q4_K_M with fallbacks (rows of 384)


def test_the_first_start_serves_before_its_cache_file_is_synced(gguf_path, cache, monkeypatch):
    reference = logits(runner(gguf_path))
    for f in cache.iterdir():
        f.unlink()
    release, real = threading.Event(), weight_cache._finish
    monkeypatch.setattr(weight_cache, "_finish", lambda tmp, path: (release.wait(), real(tmp, path)))
    first = runner(gguf_path, settle=False)
    try:
        (tmp,) = cache.iterdir()  # the sync waits: only the temporary file, its pages served
        assert tmp.name.endswith(f".bin.tmp.{os.getpid()}")
        assert logits(first).equal(reference)
    finally:
        threading.Timer(0.2, release.set).start()  # (a failure above must not leave the sync waiting)
    second = runner(gguf_path, settle=False)  # the same file: waits for the first's sync, then maps it
    (path,) = cache.iterdir()
    assert path.suffix == ".bin" and path.name == tmp.name.split(".tmp.")[0]
    assert logits(second).equal(reference) and logits(first).equal(reference)


def test_a_sync_that_fails_warns_and_leaves_no_file(gguf_path, cache, monkeypatch, caplog):
    def no_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(weight_cache.os, "fsync", no_fsync)
    with caplog.at_level(logging.WARNING, logger="hotprefix.model.weight_cache"):
        r = runner(gguf_path)
    assert "could not keep" in caplog.text and "Input/output error" in caplog.text
    assert not list(cache.iterdir())
    assert torch.isfinite(logits(r)).all()  # its pages stay mapped: the file's inode lives while they do


class NoRoom:
    free = 1 << 20


def test_the_cache_holds_the_bits_of_regrouping_in_memory(gguf_path, cache, monkeypatch):
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda p: NoRoom)
    in_memory = runner(gguf_path)  # no room: regrouped in memory, with a warning
    assert not cache.exists() or not list(cache.glob("*.bin"))
    monkeypatch.undo()
    monkeypatch.setenv("HOTPREFIX_CACHE", str(cache.parent))
    mapped = runner(gguf_path)
    assert all(a.raw.equal(b.raw) for a, b in zip(int8_weights(in_memory), int8_weights(mapped)))
    assert logits(in_memory).equal(logits(mapped))


def test_no_space_regroups_in_memory_with_a_warning(gguf_path, cache, monkeypatch, caplog):
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda p: NoRoom)
    with caplog.at_level(logging.WARNING, logger="hotprefix.model.weight_cache"):
        r = runner(gguf_path)
    assert "cannot keep them" in caplog.text and "GB free" in caplog.text
    assert not list(cache.glob("*.bin")) and not list(cache.glob("*.tmp.*"))
    assert torch.isfinite(logits(r)).all()


@pytest.mark.parametrize("damage", ["truncate", "index", "magic"])
def test_a_torn_or_foreign_cache_file_is_rebuilt(gguf_path, cache, damage):
    runner(gguf_path)
    (path,) = cache.glob("*.bin")
    good = path.read_bytes()
    data = bytearray(good)
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "index":
        data[20:24] = b"{{{{"
    else:
        data[:4] = b"NOPE"
    path.write_bytes(bytes(data))
    runner(gguf_path)
    assert path.read_bytes() == good


def test_leftovers_of_killed_writers_are_removed(gguf_path, cache):
    runner(gguf_path)
    (path,) = cache.glob("*.bin")
    dead = cache / f"{path.name}.tmp.999999999"  # no such process
    live = cache / f"{path.name}.tmp.1"  # init: alive
    stale = cache / (path.name.split("-")[0] + "-0000000000000000.bin")  # the same model file, other sources
    for f in (dead, live, stale):
        f.write_bytes(b"partial")
    path.unlink()
    runner(gguf_path)
    assert not dead.exists() and not stale.exists() and live.exists() and path.exists()


def test_a_writer_that_fails_midway_leaves_nothing(gguf_path, cache, monkeypatch):
    calls = []
    real = PackedWeight.regrouped

    def fail_on_fifth(self, lib=None, out=None):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk went away")
        return real(self, lib, out)

    monkeypatch.setattr(PackedWeight, "regrouped", fail_on_fifth)
    r = runner(gguf_path)  # the failure is an OSError: this start regroups in memory
    assert not list(cache.glob("*.bin")) and not list(cache.glob("*.tmp.*"))
    assert torch.isfinite(logits(r)).all()


def test_an_updated_model_file_gets_a_new_cache(gguf_path, cache, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    runner(copy)
    (old,) = cache.glob("*.bin")
    os.utime(copy, ns=(old.stat().st_mtime_ns + 10**9, old.stat().st_mtime_ns + 10**9))
    runner(copy)
    (new,) = cache.glob("*.bin")
    assert new != old and not old.exists()
