"""The CUDA path (run on a lent GPU machine; skipped without CUDA): paged attention
(torch and triton backends), CUDA-graph replay, mixed batches, fp8 KV, swap through
pinned host memory, and agreement with the CPU."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config import CacheConfig, ModelConfig, SchedulerConfig
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.model.loader import load_model
from hotprefix.model.runner import ModelRunner
from hotprefix.model.steps.cuda_graphs import DecodeGraphs
from tests.conftest import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-tiny")
    return d, build_tiny_model(d, "qwen3", seed=4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_fp32_logits_match_transformers(model_dir, backend):
    d, hf = model_dir
    runner = ModelRunner(load_model(str(d)), ModelConfig(device="cuda", dtype="float32", attention_backend=backend),
                         CacheConfig(block_size=4, num_blocks_override=32), SchedulerConfig())
    assert runner.kv_cache.layers[0].k.is_cuda
    ids = list(range(3, 40))
    so = SchedulerOutput([ScheduledRequest("x", ids[:21], 0, [5, 9, 2, 30, 7, 11, 12, 13, 14, 15], True,
                                           SamplingParams(), ids, [])])
    first = runner.all_logits(so).cpu()
    so = SchedulerOutput([ScheduledRequest("x", ids[21:], 21, [5, 9, 2, 30, 7, 11, 12, 13, 14, 15], True,
                                           SamplingParams(), ids, [])])
    ours = torch.cat([first, runner.all_logits(so).cpu()])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-4


@pytest.mark.parametrize("kw", [
    {},
    {"num_blocks_override": 14, "max_num_batched_tokens": 32, "preemption_mode": "swap", "swap_space": "1MiB"},
])
def test_cuda_generation_matches_cpu(model_dir, kw):
    d, _ = model_dir
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
    cpu = LLM(model=str(d), device="cpu", block_size=4, num_blocks_override=128).generate(prompts, GREEDY)
    gpu_kw = {"num_blocks_override": 128, "dtype": "float32", **kw}  # auto would be bf16 on CUDA
    llm = LLM(model=str(d), device="cuda", block_size=4, **gpu_kw)
    outs = llm.generate(prompts, GREEDY)
    assert [a.outputs[0].token_ids for a in cpu] == [b.outputs[0].token_ids for b in outs]
    if "swap_space" in kw:
        assert llm.engine.runner.num_swapped_blocks_total > 0
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("dtype,kv,bound", [("bfloat16", "auto", 0.05), ("float32", "fp8", 0.02),
                                            ("float32", "fp8_e5m2", 0.02)])
def test_cuda_low_precision_logits_close_to_cpu(model_dir, dtype, kv, bound):
    """Teacher-forced logits on CUDA against the CPU at the same KV dtype (fp32 compute
    on the CPU): mean |error| / mean |logit| within the stated bound."""
    d, _ = model_dir
    ids = list(range(3, 40))

    def logits(device: str, dt: str) -> torch.Tensor:
        runner = ModelRunner(load_model(str(d)), ModelConfig(device=device, dtype=dt),
                             CacheConfig(block_size=4, num_blocks_override=16, kv_cache_dtype=kv), SchedulerConfig())
        so = SchedulerOutput([ScheduledRequest("x", ids, 0, list(range(10)), True, SamplingParams(), ids, [])])
        return runner.all_logits(so).float().cpu()

    ref, got = logits("cpu", "float32"), logits("cuda", dtype)
    assert float((got - ref).abs().mean() / ref.abs().mean()) <= bound


def test_cuda_seeded_sampling_is_reproducible(model_dir):
    d, _ = model_dir
    llm = LLM(model=str(d), device="cuda", num_blocks_override=64)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    assert a == b


def test_cuda_pool_sized_from_gpu_memory_utilization(model_dir):
    d, _ = model_dir
    llm = LLM(model=str(d), device="cuda", gpu_memory_utilization=0.05)
    total = torch.cuda.mem_get_info()[1]
    plan = llm.engine.runner.plan
    assert 0 < plan.num_blocks * plan.bytes_per_block <= 0.05 * total


def test_cuda_graph_replay_equals_eager(model_dir):
    """Decode steps replayed from CUDA graphs (batch sizes padded up to 1, 2, 4, 8) give
    the eager steps' tokens, for batches of every size up to 8 and past it (eager)."""
    d, _ = model_dir
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9, 12, 3, 22, 8, 15, 4)]
    kw = dict(device="cuda", dtype="float32", block_size=4, num_blocks_override=256, max_num_seqs=10,
              attention_backend="triton")
    graphed = LLM(model=str(d), cuda_graph_sizes=(1, 2, 4, 8), **kw)
    assert sorted(graphed.engine.runner.strategy(DecodeGraphs).graphs) == [1, 2, 4, 8]
    eager = LLM(model=str(d), enforce_eager=True, **kw)
    assert eager.engine.runner.strategy(DecodeGraphs) is None
    for n in (1, 3, 8, 10):
        a = [o.outputs[0].token_ids for o in graphed.generate(prompts[:n], GREEDY)]
        b = [o.outputs[0].token_ids for o in eager.generate(prompts[:n], GREEDY)]
        assert a == b


def test_cuda_dummy_weights_in_bfloat16(model_dir):
    d, _ = model_dir
    llm = LLM(model=str(d), load_format="dummy", device="cuda", num_blocks_override=64)
    w = llm.engine.runner.model.model.layers[0].mlp.up_proj.weight
    assert w.is_cuda and w.dtype == torch.bfloat16
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 12
