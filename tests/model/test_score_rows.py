"""The scoring kernel (csrc/score.c, ops.score_rows) and the runner's prompt logprobs:
each row's target logprob over the full vocabulary's log-sum-exp, its rank and top k
agree with torch's; a row's result is the same bits alone or among others, chunked or
whole, from the cache or computed, and on every build of the kernels."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model.kernels import abi as kernel_abi
from hotprefix.model.kernels import build, ops
from hotprefix.sampling_params import SamplingParams
from tests.model.test_block_kernels import MARCHES


@pytest.fixture(scope="module")
def libs():
    out = []
    for march, defines in MARCHES:
        path = build.build_library(march=march, defines=defines)
        assert path is not None, f"the kernel did not build for -march={march} {defines}"
        out.append(kernel_abi.bind(path))
    return out


def logits_rows(r: int = 37, v: int = 1003, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, v, generator=g) * 4
    x[5, :] = 0.0  # a flat row: every token ties
    x[6, 17] = x[6, 900] = 30.0  # two tokens tie at the top
    return x, torch.randint(0, v, (r,), generator=g)


def test_score_rows_agrees_with_torch(libs):
    x, t = logits_rows()
    lp, rank, top_ids, top_lp = ops.score_rows(x, t, 5, libs[0])
    lse = torch.logsumexp(x.double(), -1)
    chosen = x.gather(1, t[:, None])[:, 0]
    assert float((lp.double() - (chosen.double() - lse)).abs().max()) < 2e-6
    assert torch.equal(rank, (x > chosen[:, None]).sum(-1) + 1)
    vals, _ = torch.topk(x, 5, -1)
    assert torch.equal(x.gather(1, top_ids), vals)  # the k largest, largest first
    assert float((top_lp.double() - (vals.double() - lse[:, None])).abs().max()) < 2e-6
    assert top_ids[5].tolist() == [0, 1, 2, 3, 4] and top_ids[6, :2].tolist() == [17, 900]  # ties: lower id first
    assert rank[5] == 1


def test_a_rows_result_is_the_same_bits_alone_and_on_every_build(libs):
    x, t = logits_rows()
    whole = ops.score_rows(x, t, 3, libs[0])
    for i in (0, 5, 6, 36):
        alone = ops.score_rows(x[i:i + 1], t[i:i + 1], 3, libs[0])
        assert all(torch.equal(a[0], w[i]) for a, w in zip(alone, whole))
    for lib in libs[1:]:
        assert all(torch.equal(a, w) for a, w in zip(ops.score_rows(x, t, 3, lib), whole))


@pytest.mark.parametrize("targets,k", [([0, 4], 1), ([0], 1), ([0, 1], 5)])
def test_score_rows_refuses_what_it_cannot_read(targets, k, libs):
    with pytest.raises(ValueError):
        ops.score_rows(torch.zeros(2, 4), torch.tensor(targets), k, libs[0])


def test_prompt_logprobs_are_the_same_bits_chunked_cached_or_in_a_batch(tiny_llama):
    from hotprefix.engine.llm import LLM

    prompt = list(range(3, 60))
    want = None
    for budget, caching in ((512, False), (7, False), (5, True)):
        llm = LLM(str(tiny_llama[0]), max_num_batched_tokens=budget, block_size=4, num_gpu_blocks_override=64,
                  enable_prefix_caching=caching)
        p = SamplingParams(max_tokens=0, prompt_logprobs=4)
        outs = llm.generate([prompt, prompt[:20], prompt], [p, p, p])  # the third: cached blocks, kept logprobs
        got = [[(e.sampled.logprob, e.sampled.rank, [(a.token_id, a.logprob) for a in e.top])
                for e in o.prompt_logprobs[1:]] for o in (outs[0], outs[2])]
        assert got[0] == got[1]
        want = want or got[0]
        assert got[0] == want
        if caching:
            assert outs[2].num_cached_tokens == 56


def test_prompt_logprobs_through_the_reused_logits_buffer_are_the_same_bits(monkeypatch):
    """The default model's head is C blocks: its prompt-logprob slices are written into one
    buffer the runner keeps (no fresh pages each slice); the results are those of fresh tensors."""
    from hotprefix.engine.llm import LLM
    from hotprefix.model import runner as runner_mod

    monkeypatch.setattr(runner_mod, "PROMPT_LOGPROB_ROWS", 16)  # 50- and 23-token prompts: several slices
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompts = [[(31 * i) % 40000 + 100 for i in range(50)], [(17 * i) % 30000 + 200 for i in range(23)]]
    p = SamplingParams(max_tokens=0, prompt_logprobs=3)

    def scored() -> list:
        return [[(e.sampled.token_id, e.sampled.logprob, e.sampled.rank, [(a.token_id, a.logprob) for a in e.top])
                 for e in o.prompt_logprobs[1:]] for o in llm.generate(prompts, [p, p])]

    outs, real = [], ops.qmatmul
    monkeypatch.setattr(ops, "qmatmul", lambda x, w, lib=None, out=None: outs.append(out) or real(x, w, lib, out))
    through_buffer = scored()
    monkeypatch.setattr(ops, "qmatmul", real)
    buf = llm.engine.runner._score_logits
    assert buf is not None and tuple(buf.shape) == (16, llm.engine.runner.model.logits_blocks.n)
    # every slice's head product wrote into the buffer: 4 slices of the first prompt, 2 of the second
    assert sum(o is not None and o.data_ptr() == buf.data_ptr() for o in outs) == 6
    assert [len(rows) for rows in through_buffer] == [49, 22]
    monkeypatch.setattr(runner_mod.ModelRunner, "_score_buffer", lambda self, rows: None)
    assert scored() == through_buffer
