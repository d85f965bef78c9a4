"""A mixture of experts through the engine: a request's answer is the answer it gets
alone (batch invariance: its neighbours, its cached prefix and the chunking change no
bit of it), in int8 and float32 mode; `--load-format dummy` and `hotprefix size` know
the mixtures' shapes."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from hotprefix import LLM, SamplingParams
from hotprefix.model.arch import arch_from_hf_config
from hotprefix.model.dummy import weight_shapes
from hotprefix.model.loader import load_model
from hotprefix.model.presets import PRESETS
from tests.conftest import build_tiny_model
from tests.gguf_util import write_gguf
from tests.model.test_batch_invariance import _sp, answer, make_engine, run_interleaved
from tests.model.test_qwen3_moe import GGUF_MOE


@pytest.fixture(scope="module")
def moe_loaded(tmp_path_factory):
    """A Q4_K_M file of a tiny MoE (8 experts, 2 a token) and its model."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("moe-inv")
    model = build_tiny_model(d / "src", "qwen3moe", seed=9, **GGUF_MOE)
    path = write_gguf(d / "moe-Q4_K_M.gguf", model, AutoTokenizer.from_pretrained(str(d / "src")), "Q4_K_M",
                      arch="qwen3moe")
    return load_model(str(path))


@pytest.mark.parametrize("mode", ["int8", "float32"])
def test_every_answer_is_the_answer_alone(moe_loaded, mode):
    """Six requests on two shared prefixes, added while others run, prefilled in chunks of
    at most 13 tokens beside decodes, prefix caching on: each one's tokens and top-20
    logprobs equal, bit for bit, its run alone with caching off."""
    rng = random.Random(4)
    prefixes = [[rng.randrange(3, 320) for _ in range(n)] for n in (17, 9)]
    requests = [(prefixes[i % 2] + [rng.randrange(3, 320) for _ in range(1 + i)], _sp(None if i % 3 else i, 6 + i),
                 (0, 1, 3)[i % 3]) for i in range(6)]
    reference = make_engine(moe_loaded, mode, caching=False)
    alone = [answer(run_interleaved(reference, [(p, sp, 0)])[0]) for p, sp, _ in requests]
    engine = make_engine(moe_loaded, mode, caching=True, max_num_batched_tokens=13)
    finals = run_interleaved(engine, requests)
    assert [answer(finals[i]) for i in range(6)] == alone
    assert sum(finals[i].num_cached_tokens > 0 for i in range(6)) >= 3  # prefix hits happened


def test_dummy_weights_have_the_mixtures_shape():
    """qwen3-30b-a3b's modules, built on the meta device: 128 experts of [768, 2048] a
    layer, a router of [128, 2048]; their parameters are exactly what sizing counts."""
    arch = arch_from_hf_config(PRESETS["qwen3-30b-a3b"])
    shapes = weight_shapes(arch)
    layer = "model.layers.47.mlp"
    assert shapes[f"{layer}.gate.weight"] == (128, 2048)
    assert shapes[f"{layer}.experts.gate_proj.weight"] == shapes[f"{layer}.experts.up_proj.weight"] == (128, 768, 2048)
    assert shapes[f"{layer}.experts.down_proj.weight"] == (128, 2048, 768)
    assert sum(math.prod(s) for s in shapes.values()) == arch.shape.num_params()


def test_a_dummy_load_of_a_mixture_generates(tmp_path):
    build_tiny_model(tmp_path, "qwen3moe", seed=2)
    llm = LLM(model=str(tmp_path), load_format="dummy", device="cpu", block_size=4, num_blocks_override=32)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.kernel is not None and experts.gate.shape == (8, 32, 64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and int(experts.reads.sum()) > 0


def test_size_answers_for_qwen3_30b_a3b():
    """Total and active parameters as Qwen publishes them (30.5 B, 3.3 B activated:
    30.53 and 3.35, the embedding table and the head counted), and the weight bytes of each."""
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", "qwen3-30b-a3b", "--json",
                        "--weight-dtype", "bfloat16"], capture_output=True, text=True, check=True)
    got = json.loads(r.stdout)
    shape = arch_from_hf_config(PRESETS["qwen3-30b-a3b"]).shape
    assert (shape.num_params() // 10**7, shape.num_params(active=True) // 10**7) == (3053, 335)
    assert got["weight_bytes"] == 2 * shape.num_params()
    assert got["active_weight_bytes"] == 2 * shape.num_params(active=True)
    assert got["shape"]["num_experts"] == 128 and got["shape"]["moe_layers"] == 48
    assert got["reports"][0]["bytes_per_token"] == 2 * 48 * 4 * 128 * 4  # float32 K and V: 96 KiB a token
