"""The scoring kernels (csrc/score.c: scores.score_rows on logits, scores.score_head on an int8
head's blocks without making the logits) and the runner's prompt logprobs: each row's
target logprob over the full vocabulary's log-sum-exp, its rank and top k agree with
torch's; a row's result is the same bits alone or among others, chunked or whole, from
the cache or computed, with any number of threads, and on every build of the kernels."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model.kernels import abi as kernel_abi
from hotprefix.model.kernels import build, ops, scores
from hotprefix.sampling_params import SamplingParams
from tests.model.test_block_kernels import MARCHES, TYPES, packed


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
    lp, rank, top_ids, top_lp = scores.score_rows(x, t, 5, libs[0])
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
    whole = scores.score_rows(x, t, 3, libs[0])
    for i in (0, 5, 6, 36):
        alone = scores.score_rows(x[i:i + 1], t[i:i + 1], 3, libs[0])
        assert all(torch.equal(a[0], w[i]) for a, w in zip(alone, whole))
    for lib in libs[1:]:
        assert all(torch.equal(a, w) for a, w in zip(scores.score_rows(x, t, 3, lib), whole))


@pytest.mark.parametrize("targets,k", [([0, 4], 1), ([0], 1), ([0, 1], 5)])
def test_score_rows_refuses_what_it_cannot_read(targets, k, libs):
    with pytest.raises(ValueError):
        scores.score_rows(torch.zeros(2, 4), torch.tensor(targets), k, libs[0])


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
    """Scored from logits (as a head not scored on its blocks is), the default model's C-block
    head writes its prompt-logprob slices into one buffer the runner keeps (no fresh pages
    each slice); the results are those of fresh tensors."""
    from hotprefix.engine.llm import LLM
    from hotprefix.model import scoring

    monkeypatch.setattr(scoring, "PROMPT_LOGPROB_ROWS", 16)  # 50- and 23-token prompts: several slices
    monkeypatch.setattr(scoring.PromptScorer, "on_head", lambda self, hidden: False)
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
    buf = llm.engine.runner.scorer.buffer
    assert buf is not None and tuple(buf.shape) == (16, llm.engine.runner.model.logits_blocks.n)
    # every slice's head product wrote into the buffer: 4 slices of the first prompt, 2 of the second
    assert sum(o is not None and o.data_ptr() == buf.data_ptr() for o in outs) == 6
    assert [len(rows) for rows in through_buffer] == [49, 22]
    monkeypatch.setattr(scoring.PromptScorer, "_buffer", lambda self, rows: None)
    assert scored() == through_buffer


def test_the_default_models_prompt_logprobs_on_its_head_are_those_of_its_logits(monkeypatch):
    """The default model's int8 head scores prompt logprobs on its blocks (no logits made):
    the ranks and top ids of the logits path, logprobs within float rounding of it; the same
    bits chunked (a 7-token budget), in slices of 16 rows, from the cache or in a batch."""
    from hotprefix.engine.llm import LLM
    from hotprefix.model import scoring

    prompt = [(31 * i) % 40000 + 100 for i in range(60)]
    p = SamplingParams(max_tokens=0, prompt_logprobs=3)

    def scored(on_head: bool = True, **kw) -> list:
        llm = LLM(kv_cache_memory="64MiB", **kw)
        outs = llm.generate([prompt, prompt[:25], prompt], [p, p, p])
        assert (llm.engine.runner.scorer.buffer is None) == on_head  # no logits buffer made on the head
        rows = [[(e.sampled.token_id, e.sampled.logprob, e.sampled.rank, [(a.token_id, a.logprob) for a in e.top])
                 for e in o.prompt_logprobs[1:]] for o in outs]
        llm.close()
        return rows

    on_head = scored(enable_prefix_caching=False)
    assert on_head[0] == on_head[2] and on_head[1] == on_head[0][:24] and len(on_head[0]) == 59
    assert scored(max_num_batched_tokens=7, block_size=4) == on_head  # chunked; the third from the cache
    monkeypatch.setattr(scoring, "SCORE_HEAD_ROWS", 16)
    assert scored(enable_prefix_caching=False) == on_head
    monkeypatch.setattr(scoring.PromptScorer, "on_head", lambda self, hidden: False)
    from_logits = scored(False, enable_prefix_caching=False)[0]
    assert [(t, r, [a for a, _ in top]) for t, _, r, top in from_logits] == [
        (t, r, [a for a, _ in top]) for t, _, r, top in on_head[0]]
    assert max(abs(a[1] - b[1]) for a, b in zip(from_logits, on_head[0])) < 1e-4


def tied_head(type_name: str, lib, v: int = 2100, k: int = 256) -> tuple:
    """A [v, k] int8 head (v: 3 segments of 1,024 logits, the last group padded) whose rows 7
    and 1,500 are the same blocks (their logits tie, in different segments), and its float rows."""
    w, ref = packed(type_name, v, k, seed=3)
    raw = w.raw.clone()
    raw[1500] = raw[7]
    w = type(w).from_gguf(type_name, raw, v, k)
    ref[1500] = ref[7]
    return w.regrouped(lib), ref


@pytest.mark.parametrize("type_name", TYPES)
def test_scores_on_the_head_are_those_of_its_logits(type_name, libs):
    """score_head against score_rows of the same head's qmatmul logits: the same ranks and top
    ids (ties in two segments: the lower id first), logprobs as close to float64's."""
    lib = libs[0]
    head, ref = tied_head(type_name, lib)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(150, 256, generator=g)  # a 128-row chunk and a 22-row one (AMX tiles where there are)
    x[0] = ref[7] * 3.0  # row 0's largest logits (~1,500): the tied pair
    t = torch.randint(0, 2100, (150,), generator=g)
    t[1], t[2] = 7, 1500  # targets in the tie
    logits = ops.qmatmul(x, head, lib)
    lse = torch.logsumexp(logits.double(), -1)
    chosen = logits.gather(1, t[:, None])[:, 0]
    for k in (0, 1, 5):
        lp, rank, top_ids, top_lp = scores.score_head(x, head, t, k, lib)
        _, want_rank, want_ids, _ = scores.score_rows(logits, t, k, lib)
        assert torch.equal(rank, want_rank) and torch.equal(rank, (logits > chosen[:, None]).sum(-1) + 1)
        assert torch.equal(top_ids, want_ids)
        tol = 2e-6 + 4 * 2**-24 * lse.abs()  # [R]: float32's rounding at the row's magnitude
        assert bool(((lp.double() - (chosen.double() - lse)).abs() < tol).all())
        if k:
            assert top_ids[0, :2].tolist() == [7, 1500][:k]
            vals = logits.gather(1, top_ids).double()
            assert bool(((top_lp.double() - (vals - lse[:, None])).abs() < tol[:, None]).all())


def test_a_rows_score_on_the_head_is_the_same_bits_alone_in_any_batch_threads_and_build(libs):
    head, _ = tied_head("Q8_0", libs[0])
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(150, 256, generator=g), torch.randint(0, 2100, (150,), generator=g)
    whole = scores.score_head(x, head, t, 3, libs[0])
    for a, b in ((0, 1), (149, 150), (10, 40), (5, 150)):
        part = scores.score_head(x[a:b], head, t[a:b], 3, libs[0])
        assert all(torch.equal(p, w[a:b]) for p, w in zip(part, whole))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert all(torch.equal(p, w) for p, w in zip(scores.score_head(x, head, t, 3, libs[0]), whole))
    finally:
        torch.set_num_threads(threads)
    for lib in libs[1:]:
        assert all(torch.equal(p, w) for p, w in zip(scores.score_head(x, head, t, 3, lib), whole))


def test_score_head_refuses_what_it_cannot_read(libs):
    head, _ = tied_head("Q4_0", libs[0])
    x, t = torch.randn(2, 256), torch.tensor([0, 1])
    float_head, _ = packed("Q4_0", 2100, 256)  # GGUF rows, not the int8 layout
    for args in ((x, float_head, t, 1), (x, head, torch.tensor([0, 2100]), 1), (x, head, torch.tensor([-1, 0]), 1),
                 (x, head, t, 2101), (x, head, t, -1), (x[:, :128], head, t, 1), (x, head, t[:1], 1)):
        with pytest.raises(ValueError):
            scores.score_head(*args, lib=libs[0])
    with pytest.raises(ValueError):
        scores.score_head(x.double(), head, t, 1, libs[0])
    assert [v.shape for v in scores.score_head(x[:0], head, t[:0], 2, libs[0])] == [(0,), (0,), (0, 2), (0, 2)]


def test_a_last_segment_narrower_than_k_and_targets_in_it(libs):
    """V = 2,050: the last segment holds 2 logits, fewer than k = 5: its top list is short and
    the merge takes the rest from the segments before it."""
    w, _ = packed("Q8_0", 2050, 256, seed=5)
    head = w.regrouped(libs[0])
    g = torch.Generator().manual_seed(6)
    x, t = torch.randn(40, 256, generator=g), torch.randint(0, 2050, (40,), generator=g)
    t[:4] = torch.tensor([2048, 2049, 2047, 0])
    logits = ops.qmatmul(x, head, libs[0])
    lp, rank, top_ids, top_lp = scores.score_head(x, head, t, 5, libs[0])
    _, want_rank, want_ids, want_lp = scores.score_rows(logits, t, 5, libs[0])
    assert torch.equal(rank, want_rank) and torch.equal(top_ids, want_ids)
    assert float((top_lp - want_lp).abs().max()) < 1e-4


def test_the_c_side_refuses_a_target_or_k_past_the_head(libs):
    """hp_score_head checks what its wrapper checks (a target outside the vocabulary would
    index a group past the head): -1, nothing written."""
    head, _ = tied_head("Q8_0", libs[0])
    x = torch.randn(2, 256)
    outs = [torch.full((2,), 7.0), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64),
            torch.zeros(2, 1)]
    for targets, k in (([0, 2100], 1), ([-1, 0], 1), ([0, 1], 2101), ([0, 1], -1)):
        t = torch.tensor(targets, dtype=torch.int64)
        rc = libs[0].hp_score_head(head.part_table, x.data_ptr(), 2, 256, t.data_ptr(), k,
                                   *(o.data_ptr() for o in outs), 1)
        assert rc == -1 and outs[0].tolist() == [7.0, 7.0]
