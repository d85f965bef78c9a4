"""hotprefix's logits against transformers' on tiny random models.

Relative error = max |ours - ref| / max |ref| over all compared logits; the
issue's bound is 1e-4 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from hotprefix.config import CacheConfig, ModelConfig, SchedulerConfig
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.model.loader import load_model
from hotprefix.model.runner import ModelRunner
from hotprefix.sampling_params import SamplingParams
from tests.conftest import build_tiny_model

BLOCK = 4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-sharded": ("llama", {"max_shard_size": "100KB"}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
}


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [L, V]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def run_chunks(runner: ModelRunner, seqs: dict[str, list[int]], steps: list[dict[str, int]],
               blocks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Feed each sequence through the runner in the given chunk sizes (one dict
    per step: name -> tokens this step) and collect its logits per position. A grouped
    pool's window groups get tables of their own, from the blocks no sequence names."""
    done = {k: 0 for k in seqs}
    tables = group_tables(runner, blocks)
    got: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}
    for step in steps:
        reqs = []
        for name, n in step.items():
            start = done[name]
            reqs.append(ScheduledRequest(name, seqs[name][start:start + n], start, blocks[name], True,
                                         SamplingParams(), seqs[name], [], group_block_ids=tables[name]))
            done[name] += n
        logits = runner.all_logits(SchedulerOutput(reqs))
        off = 0
        for r in reqs:
            got[r.request_id].append(logits[off:off + len(r.token_ids)])
            off += len(r.token_ids)
    assert all(done[k] == len(v) for k, v in seqs.items()), "the steps must cover every token"
    return {k: torch.cat(v) for k, v in got.items()}


def group_tables(runner: ModelRunner, blocks: dict[str, list[int]]) -> dict[str, tuple[list[int], ...]]:
    """Each sequence's table in every KV-cache group of a grouped pool (the full group's: `blocks`; each
    window group's: as many blocks that no sequence names); () for a one-group pool."""
    if runner.kv_groups is None:
        return {k: () for k in blocks}
    used = {b for v in blocks.values() for b in v}
    free = iter(b for b in range(runner.plan.num_blocks) if b not in used)
    return {k: (v, *[[next(free) for _ in v] for _ in runner.kv_groups.windows[1:]]) for k, v in blocks.items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mixed_chunked_batches_match_transformers(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    hf = build_tiny_model(tmp_path, family, seed=3, **overrides)
    cache = CacheConfig(block_size=BLOCK, num_blocks_override=64)
    runner = ModelRunner(load_model(str(tmp_path)), ModelConfig(device="cpu"), cache, SchedulerConfig())
    g = torch.Generator().manual_seed(7)
    seqs = {name: torch.randint(3, 320, (n,), generator=g).tolist() for name, n in
            (("a", 23), ("b", 9), ("c", 30), ("d", 1))}
    # Non-contiguous, shuffled block tables so that paging is exercised.
    perm = torch.randperm(64, generator=g).tolist()
    blocks = {"a": perm[0:6], "b": perm[6:9], "c": perm[9:17], "d": perm[17:18]}
    steps = [
        {"a": 5, "b": 9, "c": 3},           # prefill chunks of different lengths, one whole prompt
        {"a": 11, "b": 0, "c": 1, "d": 1},  # chunk crossing block boundaries; decode-sized steps
        {"a": 1, "c": 20},
        {"a": 6, "c": 6},
    ]
    steps = [{k: v for k, v in s.items() if v} for s in steps]
    ours = run_chunks(runner, seqs, steps, blocks)
    for name, ids in seqs.items():
        err = rel_err(ours[name], hf_logits(hf, ids))
        assert err <= 1e-4, f"{variant}/{name}: relative error {err:.2e}"


def test_untied_lm_head_is_used(tmp_path):
    """An untied model's logits must come from lm_head, not the embedding."""
    build_tiny_model(tmp_path, "llama", seed=1)
    runner = ModelRunner(load_model(str(tmp_path)), ModelConfig(device="cpu"), CacheConfig(num_blocks_override=8),
                         SchedulerConfig())
    assert not runner.arch.tie_word_embeddings
    assert not torch.equal(runner.model.lm_head.weight, runner.model.model.embed_tokens.weight)
