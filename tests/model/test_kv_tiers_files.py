"""The host and disk KV tiers on the default model, with real files: tier hits give
the same greedy tokens as computing (float32 activations: token-identical), and a
corrupt, truncated, foreign or unwritable tier is a miss or a warning, never wrong KV
and never a failed request."""

from __future__ import annotations

import errno
import itertools
import logging
import os
from pathlib import Path

import pytest

from hotprefix.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from hotprefix.engine.kv_disk import KEY_FILE, SUFFIX, DiskStore
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.model.loader import load_model
from hotprefix.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
TEXT = " ".join(f"item{i} costs {i * 7 % 13} coins;" for i in range(60))  # ~420 tokens
_ids = itertools.count()


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def engine(loaded, **cache) -> LLMEngine:
    cache.setdefault("num_blocks_override", 48)
    return LLMEngine(EngineConfig(ModelConfig(quantized_matmul="float32"), CacheConfig(**cache)), loaded=loaded)


def run(e: LLMEngine, prompt: str, n: int = 8) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request, run to the end."""
    rid = f"t{next(_ids)}"
    e.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0))
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final = out
    e.scheduler.check_integrity()
    return final.outputs[0].token_ids, final.num_cached_tokens


@pytest.fixture(scope="module")
def cold(loaded):
    """The reference: the prompt computed from scratch, with no tier."""
    return run(engine(loaded), TEXT + " Q1")[0]


def disk_files(d: Path) -> list[Path]:
    return sorted(d.glob("*/*" + SUFFIX))


def test_host_tier_hits_after_eviction_match_computing(loaded, cold):
    e = engine(loaded, kv_offloading_size=64 << 20)
    assert run(e, TEXT + " Q1") == (cold, 0)
    run(e, " ".join(f"other{i}" for i in range(170)))  # evicts the first prompt's blocks
    tokens, cached = run(e, TEXT + " Q1")
    stats = e.scheduler.make_stats().tiers
    assert tokens == cold and cached == (len(e.tokenize(TEXT + " Q1")) - 1) // 16 * 16
    assert stats.hit_blocks[stats_source("host")] > 0 and stats.loaded_blocks == stats.hit_blocks[stats_source("host")]


def stats_source(name: str):
    from hotprefix.core.kv_tiers import Source

    return Source(name)


def test_disk_tier_survives_a_restart_and_refuses_bad_files(loaded, cold, tmp_path, caplog):
    n_prompt = len(loaded.tokenizer(TEXT + " Q1")["input_ids"])
    full = (n_prompt - 1) // 16
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    assert run(e, TEXT + " Q1") == (cold, 0)
    e.close()
    files = disk_files(tmp_path)
    assert len(files) >= full  # every computed full block (the prompt's, and the output's)
    # a "restart": a new engine indexes the files and loads them
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    assert run(e, TEXT + " Q1") == (cold, full * 16)
    assert e.disk.stats.read_blocks == full
    e.close()
    # block 3's payload corrupted, block 5's file cut short: 3 is a miss (and deleted),
    # so the run stops there; the cut file is dropped at start-up without being read
    by_order = _files_in_prompt_order(e, loaded, tmp_path, TEXT + " Q1")
    data = bytearray(by_order[3].read_bytes())
    data[-1] ^= 0xFF
    by_order[3].write_bytes(bytes(data))
    with by_order[5].open("r+b") as f:
        f.truncate(100)
    caplog.set_level(logging.WARNING)
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    assert not by_order[5].exists()
    assert run(e, TEXT + " Q1") == (cold, 3 * 16)
    assert "its MAC does not match" in caplog.text
    e.close()
    # the bad file was deleted; blocks 3 and 5 were computed again and written again, right
    stats = e.disk.stats
    assert stats.bad_files == 1 and stats.read_blocks == 4 and stats.written_blocks == 2
    assert by_order[3].read_bytes() != bytes(data) and by_order[5].stat().st_size == len(data)


def _files_in_prompt_order(e: LLMEngine, loaded, d: Path, prompt: str) -> list[Path]:
    ids = loaded.tokenizer(prompt)["input_ids"]
    return [d / e.disk.dir.name / (h.hex() + SUFFIX) for h in e.kv.hasher.hashes_of(ids)]


def test_another_model_configuration_never_reads_the_files(loaded, cold, tmp_path):
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    run(e, TEXT + " Q1")
    e.close()
    other = LLMEngine(EngineConfig(ModelConfig(quantized_matmul="int8"), CacheConfig(
        num_blocks_override=48, kv_disk_dir=str(tmp_path))), loaded=loaded)
    assert run(other, TEXT + " Q1")[1] == 0  # int8 activations write other KV: another identity
    assert other.disk.stats.read_blocks == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    other.close()
    # a file whose header names another model, under this model's name, is refused when read
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    victim = _files_in_prompt_order(e, loaded, tmp_path, TEXT + " Q1")[0]
    raw = bytearray(victim.read_bytes())
    raw[8] ^= 0xFF  # the identity field, right after the magic
    victim.write_bytes(bytes(raw))
    e.close()
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    assert run(e, TEXT + " Q1") == (cold, 0)
    assert e.disk.stats.bad_files == 1
    e.close()


def test_a_full_disk_and_an_unwritable_directory_fail_no_request(loaded, cold, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    real_write = DiskStore._write
    calls = []

    def full(self, h, data):
        calls.append(h)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, h, data)

    monkeypatch.setattr(DiskStore, "_write", full)
    e = engine(loaded, kv_disk_dir=str(tmp_path))
    assert run(e, TEXT + " Q1") == (cold, 0)
    e.disk.flush()
    assert not e.disk.writable and "No space left on device" in caplog.text
    assert len(disk_files(tmp_path)) == 2 and not list(tmp_path.glob("*/.*tmp*"))
    assert run(e, TEXT + " Q2")[0]  # serving goes on
    e.close()
    monkeypatch.undo()
    e = engine(loaded, kv_disk_dir="/proc/hotprefix-kv-test")  # no one can write there, root included
    assert run(e, TEXT + " Q1") == (cold, 0)
    assert not e.disk.writable and "cannot be written" in caplog.text
    e.close()


def test_the_disk_budget_keeps_the_newest_blocks(loaded, tmp_path):
    e = engine(loaded, kv_disk_dir=str(tmp_path), kv_disk_size=1)  # measure one file, then set the budget
    per_file = e.disk.file_bytes
    e.close()
    e = engine(loaded, kv_disk_dir=str(tmp_path), kv_disk_size=10 * per_file)
    out, _ = run(e, TEXT + " Q1")
    e.disk.flush()
    names = {p.name for p in disk_files(tmp_path)}
    assert len(names) == 10 and e.disk.num_blocks == 10
    computed = loaded.tokenizer(TEXT + " Q1")["input_ids"] + out[:-1]  # the last token is never run
    written = [h.hex() + SUFFIX for h in e.kv.hasher.hashes_of(computed)]
    assert names == set(written[-10:])  # the oldest written went first
    e.close()


def test_hotprefix_size_counts_the_tiers_as_the_engine_sizes_them(loaded, tmp_path):
    from hotprefix.sizing import size_report

    e = engine(loaded, kv_offloading_size=300 << 20, kv_disk_dir=str(tmp_path), kv_disk_size=5 << 30)
    r = size_report(loaded.arch.shape, "float32", 16, prompt_tokens=1000, host_tier_bytes=300 << 20,
                    disk_tier_bytes=5 << 30)
    assert r.host_tier_blocks == e.runner.host_tier.num_slots
    assert r.disk_tier_blocks == e.disk.max_files
    assert r.disk_tier_prompts == r.disk_tier_blocks // 62  # 62 full blocks in a 1,000-token prompt
    e.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_the_host_arena_moves_blocks_bit_for_bit(dtype):
    import torch

    from hotprefix.model.kv_cache import KVCache, resolve_kv_dtype
    from hotprefix.model.kv_offload import HostArena, block_bytes

    kv = KVCache(3, 10, 4, 2, 8, resolve_kv_dtype(dtype, torch.float32), torch.device("cpu"))
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    before = [(layer.k.view(torch.uint8).clone(), layer.v.view(torch.uint8).clone()) for layer in kv.layers]
    arena = HostArena(kv, 4)
    arena.save([(7, 0), (2, 3)])
    arena.restore([(3, 5), (0, 1)])  # block 2 -> block 5, block 7 -> block 1
    gathered = arena.gather([5, 1])
    for layer, (k0, v0) in zip(kv.layers, before):
        for now, old in ((layer.k.view(torch.uint8), k0), (layer.v.view(torch.uint8), v0)):
            per_block = now.view(now.shape[0], 10, -1)  # [kv_heads, blocks, block_size * head_dim bytes]
            old_blocks = old.view(old.shape[0], 10, -1)
            assert torch.equal(per_block[:, 5], old_blocks[:, 2]) and torch.equal(per_block[:, 1], old_blocks[:, 7])
            untouched = [b for b in range(10) if b not in (1, 5)]
            assert torch.equal(per_block[:, untouched], old_blocks[:, untouched])
    assert bytes(block_bytes(gathered, 0)) == bytes(arena.slot_bytes(3)) and len(block_bytes(gathered, 1)) == \
        arena.block_bytes


def test_the_reused_write_policy_through_the_engine(loaded, cold, tmp_path):
    e = engine(loaded, kv_disk_dir=str(tmp_path), kv_disk_write="reused")
    assert run(e, TEXT + " Q1") == (cold, 0)
    e.disk.flush()
    assert disk_files(tmp_path) == []  # seen once: nothing written
    tokens, cached = run(e, TEXT + " Q1")
    e.close()
    assert tokens == cold and len(disk_files(tmp_path)) == cached // 16 > 0  # the blocks it hit


def test_the_directory_its_key_and_its_files_are_private(loaded, tmp_path):
    root = tmp_path / "kv"
    e = engine(loaded, kv_disk_dir=str(root))
    run(e, TEXT + " Q1")
    e.close()
    key = root / KEY_FILE
    assert oct(root.stat().st_mode & 0o777) == "0o700" and oct(e.disk.dir.stat().st_mode & 0o777) == "0o700"
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_bytes()) == 32
    files = disk_files(root)
    assert files and {oct(f.stat().st_mode & 0o777) for f in files} == {"0o600"}
    assert all(key.read_bytes() not in f.read_bytes() for f in files)  # the secret is never in a block file


def _refused(loaded, path, **extra) -> str:
    with pytest.raises(ConfigError) as e:
        engine(loaded, kv_disk_dir=str(path), **extra)
    msg = str(e.value)
    assert "\n" not in msg and "--kv-disk-insecure" in msg
    return msg


def test_a_directory_others_may_write_or_own_is_refused(loaded, cold, tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "group or others may write to it (mode 777)" in _refused(loaded, shared)
    link = tmp_path / "link"
    link.symlink_to(shared)
    assert "group or others may write" in _refused(loaded, link)  # a symlink to one
    assert not list(shared.iterdir())  # nothing was written before the refusal
    caplog.set_level(logging.WARNING)
    e = engine(loaded, kv_disk_dir=str(shared), kv_disk_insecure=True)  # the operator's explicit choice
    assert run(e, TEXT + " Q1") == (cold, 0) and "used anyway (--kv-disk-insecure)" in caplog.text
    e.close()
    if os.geteuid() == 0:  # another user's directory (root can make one)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        assert "belongs to user 65534" in _refused(loaded, theirs)
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    (tmp_path / "own-link").symlink_to(own)  # a symlink to a private directory is fine
    engine(loaded, kv_disk_dir=str(tmp_path / "own-link")).close()


def test_a_key_file_others_may_read_or_a_symlinked_one_is_refused(loaded, tmp_path):
    root = tmp_path / "kv"
    engine(loaded, kv_disk_dir=str(root)).close()
    key = root / KEY_FILE
    key.chmod(0o644)
    assert "its key file may be read or written by others" in _refused(loaded, root)
    key.unlink()
    (tmp_path / "elsewhere").write_bytes(b"k" * 32)
    key.symlink_to(tmp_path / "elsewhere")
    assert "its key file is a symlink" in _refused(loaded, root)


def test_a_forged_block_is_a_miss_counted_as_bad(loaded, cold, tmp_path):
    """Blocks rewritten by someone without the directory's key (NaN keys and values, or a
    block made with another directory's key) are misses, counted, never used."""
    root, other = tmp_path / "kv", tmp_path / "other"
    for d in (root, other):
        e = engine(loaded, kv_disk_dir=str(d))
        run(e, TEXT + " Q1")
        e.close()
    by_order = _files_in_prompt_order(e, loaded, root, TEXT + " Q1")
    header = 112
    data = bytearray(by_order[0].read_bytes())
    data[header:] = b"\xff" * (len(data) - header)  # NaN (0xffffffff) keys and values, header kept
    by_order[0].write_bytes(bytes(data))
    foreign = other / by_order[2].parent.name / by_order[2].name  # a valid block of another key
    by_order[2].write_bytes(foreign.read_bytes())
    e = engine(loaded, kv_disk_dir=str(root))
    assert run(e, TEXT + " Q1") == (cold, 0)  # block 0 is a miss: nothing after it is reused
    assert e.disk.stats.bad_files == 2  # both were read ahead, refused and deleted (then computed, rewritten)
    e.close()
    e = engine(loaded, kv_disk_dir=str(root))  # both rewritten with this directory's key
    n_full = (len(loaded.tokenizer(TEXT + " Q1")["input_ids"]) - 1) // 16
    assert run(e, TEXT + " Q1") == (cold, n_full * 16) and e.disk.stats.bad_files == 0
    e.close()
