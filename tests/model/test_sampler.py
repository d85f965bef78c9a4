"""The sampler on hand-made logits: exclusions, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from hotprefix.model.sampler import (
    NUCLEUS_TRIES,
    Sampler,
    SampleRow,
    apply_penalties,
    candidates,
    draw,
    filtered,
    nucleus,
    sample,
)
from hotprefix.sampling_params import SamplingParams

V = 10


def row(params: SamplingParams, prompt=(), output=(), stop_ids=(), gen=None) -> SampleRow:
    return SampleRow(params, list(prompt), list(output), tuple(stop_ids), gen)


def filter_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The row's distribution [V] (float64) as the sampler draws from it: `filtered` over
    top-k's candidates, placed back in the whole row, renormalised; excluded tokens 0."""
    x, ids = candidates(logits, p)
    probs = filtered(x, p)
    if ids is not None:
        probs = torch.zeros(logits.shape[0], dtype=probs.dtype).index_copy_(0, ids, probs)
    return probs / probs.sum()


def logits_of(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def test_greedy_takes_argmax():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    toks, _ = sampler(logits, [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))])
    assert toks == [1, 0]


def test_greedy_rows_in_one_argmax_equal_row_by_row_and_leave_sampled_rows_their_draws():
    """The greedy rows' tokens come from one argmax over their rows (one sync on a GPU, not
    one a row): the first largest logit as argmax row by row takes it (ties, -inf rows), and
    a sampled row between them draws from its own generator exactly as alone."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (7, V), generator=g).float()  # small integers: ties in most rows
    logits[2] = float("-inf")
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=11)
    params = [greedy, greedy, greedy, sampled, greedy, sampled, greedy]
    rows = [row(p, gen=torch.Generator().manual_seed(11) if p.seed else None) for p in params]
    toks, _ = Sampler()(logits.clone(), rows)
    for i, p in enumerate(params):
        if p.greedy:
            assert toks[i] == int(torch.argmax(logits[i]))
            assert toks[i] == next(j for j in range(V) if logits[i, j] == logits[i].max())
        else:
            (alone,), _ = Sampler()(logits[i:i + 1].clone(), [row(p, gen=torch.Generator().manual_seed(11))])
            assert toks[i] == alone
    all_greedy, _ = Sampler()(logits.clone(), [row(greedy) for _ in params])
    assert all_greedy == [int(torch.argmax(r)) for r in logits]


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_temperature_below_sampling_eps_is_greedy(temperature):
    """vLLM's rule: dividing the logits by a subnormal temperature overflowed to inf, and the
    softmax's inf - inf drew the vocabulary's last token every time."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 10
    for extra in ({}, {"top_k": 5}, {"top_p": 0.9}):
        p = SamplingParams(temperature=temperature, seed=1, **extra)
        assert p.greedy
        toks, _ = Sampler()(logits.clone(), [row(p, gen=torch.Generator().manual_seed(1)) for _ in range(3)])
        assert toks == [int(torch.argmax(r)) for r in logits]
    assert not SamplingParams(temperature=1e-5).greedy


def test_infinite_logits_share_the_mass_instead_of_giving_nans():
    """A repetition penalty near 0 divides the seen tokens' positive logits to +inf: sampling
    takes one of those (the limit of the distribution), never a NaN's pick (the last token)."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) * 5
    seen = list(range(0, 1000, 2))
    positive_seen = {t for t in seen if logits[0, t] > 0}
    for extra in ({}, {"top_k": 50}, {"top_p": 0.5, "min_p": 0.1}):
        p = SamplingParams(temperature=1.0, repetition_penalty=1e-300, **extra)
        got = {Sampler()(logits.clone(), [row(p, prompt=seen, gen=torch.Generator().manual_seed(s))])[0][0]
               for s in range(30)}
        assert got <= positive_seen and len(got) > 1, (extra, got)


def test_top_k_keeps_exactly_k_tokens():
    probs = filter_probs(logits_of(1, 5, 3, 4, 2), SamplingParams(top_k=2))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 3]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_top_k_candidates_keep_ties_with_the_kth_and_drop_masked_tokens():
    logits = logits_of(1, 5, 3, 5, 2, 3, float("-inf"), 0)
    for k, want in ((1, [1, 3]), (2, [1, 3]), (3, [1, 2, 3, 5]), (4, [1, 2, 3, 5])):  # ties with the k-th stay
        x, ids = candidates(logits, SamplingParams(temperature=0.5, top_k=k))
        assert ids.tolist() == want and torch.equal(x, logits[want] / 0.5)
    masked = torch.full((V,), float("-inf"))
    masked[[2, 7]] = torch.tensor([1.0, 4.0])  # a grammar allowing 2 of 10: top_k 5 keeps those 2
    x, ids = candidates(masked, SamplingParams(temperature=1.0, top_k=5))
    assert ids.tolist() == [2, 7] and x.tolist() == [1.0, 4.0]
    x, ids = candidates(logits, SamplingParams(temperature=2.0))  # top_k off: the whole row
    assert ids is None and torch.equal(x, logits / 2.0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
                                    SamplingParams(temperature=1.3, top_k=300),
                                    SamplingParams(temperature=0.5, top_k=7, top_p=0.5)])
def test_top_k_work_on_its_candidates_gives_the_whole_rows_probabilities_and_tokens(params):
    """filtered() over top-k's candidates equals filtered() over the whole row with the
    others masked (bit for bit: the softmax's sum is in id order), and sample() draws the
    token draw() takes over that whole row with the same generator: so restricting the work
    to the candidates changes no answer."""
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(49152, generator=g) * (1 + seed % 7)
        x, ids = candidates(logits, params)
        whole = torch.full_like(logits, float("-inf"))
        whole[ids] = logits[ids] / params.temperature
        probs = filtered(whole, params)
        mine = filtered(x, params)
        assert torch.equal(probs[ids], mine) and probs.count_nonzero() == mine.count_nonzero()
        for s in range(5):
            assert sample(logits, params, torch.Generator().manual_seed(s)) == \
                draw(probs, torch.Generator().manual_seed(s))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # softmax of log-probs gives these probabilities exactly.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = filter_probs(p.log(), SamplingParams(top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    probs = filter_probs(p.log(), SamplingParams(top_p=0.81))
    assert (probs > 0).tolist() == [True, True, True, False]
    probs = filter_probs(p.log(), SamplingParams(top_p=0.1))
    assert (probs > 0).tolist() == [True, False, False, False]  # the top token is always kept


def whole_sort_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """top-p as the whole row sorted decides it (the sampler's rule before nucleus())."""
    sorted_p, idx = torch.sort(probs, descending=True)
    over = (torch.cumsum(sorted_p, 0) - sorted_p) >= top_p
    over[0] = False
    first = int(torch.nonzero(over)[0]) if over.any() else len(idx)
    return set(idx[:first].tolist())


@pytest.mark.parametrize("spread", [8.0, 3.0, 2.0, 0.3])  # peaked ... flat: the nucleus in each try
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_is_the_whole_sorts_whichever_try_finds_it(spread, top_p):
    """49,152 tokens: the nucleus found among the top 256, the top 4,096 or the sorted row
    is the same set of tokens as sorting the whole row gives (no ties: continuous values)."""
    g = torch.Generator().manual_seed(int(spread * 10 + top_p * 1000))
    probs = torch.softmax(torch.randn(49152, generator=g, dtype=torch.float64).float() * spread, -1)
    got = nucleus(probs, top_p)
    assert len(set(got.tolist())) == len(got)
    assert set(got.tolist()) == whole_sort_nucleus(probs, top_p)


def test_nucleus_tries_cover_each_case():
    """The cases above reach each try: a nucleus under 256 tokens, one between 256 and
    4,096, and one past 4,096 (the sort)."""
    sizes = set()
    for spread in (8.0, 3.0, 2.0):
        g = torch.Generator().manual_seed(int(spread * 10 + 900))
        sizes.add(len(nucleus(torch.softmax(torch.randn(49152, generator=g) * spread, -1), 0.9)))
    lo, hi = NUCLEUS_TRIES
    assert any(n < lo for n in sizes) and any(lo <= n < hi for n in sizes) and any(n >= hi for n in sizes), sizes


def test_nucleus_of_tied_tokens_keeps_as_many_as_the_whole_sort():
    """All tokens equally likely: which of them are kept is the order's (topk's or sort's),
    how many is the rule's."""
    probs = torch.full((49152,), 1 / 49152)
    for top_p in (0.001, 0.05, 0.9):
        got = nucleus(probs, top_p)
        assert len(set(got.tolist())) == len(got) == len(whole_sort_nucleus(probs, top_p))


def test_min_p_drops_tokens_below_fraction_of_max():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = filter_probs(p.log(), SamplingParams(min_p=0.35))  # threshold 0.175
    assert (probs > 0).tolist() == [True, True, False, False]


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(top_k=3, temperature=2.0), {7, 8, 9}),
    (SamplingParams(top_p=0.6, temperature=1.0), {9, 8}),  # p9 = 0.55, p8 = 0.25
    (SamplingParams(min_p=0.2, temperature=1.0), {9, 8, 7}),
])
def test_sampling_never_emits_an_excluded_token(params, allowed):
    base = torch.arange(V, dtype=torch.float32) * 0.8  # increasing logits: 9 is the most likely
    sampler = Sampler(seed=123)
    # The allowed set is computed from the definitions independently of the sampler.
    probs = torch.softmax(base / params.temperature, 0)
    assert set((filter_probs(base, params) > 0).nonzero().flatten().tolist()) == allowed, probs
    seen = set()
    for _ in range(400):
        toks, _ = sampler(base.clone()[None], [row(params)])
        seen.add(toks[0])
    assert seen <= allowed
    assert len(seen) > 1  # it does sample, not just take the argmax


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5, logit_bias={9: 100.0, 2: -100.0}),
    SamplingParams(temperature=0.7, logprobs=3),
    SamplingParams(temperature=2.0, top_k=2, top_p=0.3, min_p=0.9),
    SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0, logit_bias={8: 100.0, 2: -100.0}),
])
def test_a_mask_that_allows_one_token_is_sampled_as_that_token(params):
    """Why a grammar's forced token, drafted, is kept when its mask allows it alone: greedy
    and every sampling path take the one allowed token, however unlikely the model and the
    biases make it (the grammar's mask comes first: no bias or filter brings another back)."""
    base = torch.arange(V, dtype=torch.float32) * 3.0  # token 2 among the least likely
    forbidden = torch.ones(V, dtype=torch.bool)
    forbidden[2] = False
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        toks, lps = Sampler(seed=seed)(base.clone()[None], [SampleRow(params, [2, 9], [2, 8], (), gen, forbidden)])
        assert toks == [2]
        assert params.logprobs is None or lps[0].sampled.token_id == 2


def test_same_seed_same_tokens_different_seed_differs():
    base = torch.zeros(1, 1000)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        s = Sampler(seed=999)
        return [s(base.clone(), [row(SamplingParams(seed=seed), gen=g)])[0][0] for _ in range(20)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = logits_of(2.0, -2.0, 2.0, -2.0)[None].clone()
    apply_penalties(logits, [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    assert logits[0].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_presence_and_frequency_penalties_over_output_only():
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                                 prompt=[3, 3], output=[1, 1, 1, 2])])
    # token 1: 3 * 0.25 + 0.5; token 2: 0.25 + 0.5; prompt-only token 3 untouched.
    assert logits[0].tolist() == [0.0, -1.25, -0.75, 0.0]


def test_min_tokens_suppresses_stop_ids():
    sampler = Sampler()
    logits = logits_of(0, 0, 9, 0)[None].clone()
    toks, _ = sampler(logits, [row(SamplingParams(temperature=0, min_tokens=2), output=[1], stop_ids=[2])])
    assert toks[0] != 2
    logits = logits_of(0, 0, 9, 0)[None].clone()
    toks, _ = sampler(logits, [row(SamplingParams(temperature=0, min_tokens=2), output=[1, 1], stop_ids=[2])])
    assert toks[0] == 2


def allowing(*ids: int) -> torch.Tensor:
    """A grammar's mask over V tokens that allows only `ids`."""
    forbidden = torch.ones(V, dtype=torch.bool)
    forbidden[list(ids)] = False
    return forbidden


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, min_tokens=5),
                                    SamplingParams(temperature=1.0, seed=3, min_tokens=5, top_k=3, logprobs=1)])
def test_a_grammar_that_allows_only_stop_ids_wins_over_min_tokens(params):
    """Before min_tokens, a grammar that allows only stop ids (it must end): the stop id
    its grammar allows is sampled, greedy or seeded (before, every logit was -inf: greedy
    took token 0, sampling the last token, neither one the grammar's)."""
    logits = torch.arange(V, dtype=torch.float32)[None].flip(1).clone()  # token 0 the likeliest
    r = SampleRow(params, [4], [7], (2, 3), torch.Generator().manual_seed(0), allowing(3))
    toks, lps = Sampler()(logits, [r])
    assert toks == [3] and torch.isfinite(logits[0, 3])
    assert lps[0] is None if params.logprobs is None else lps[0].sampled.token_id == 3
    assert r.forbidden.tolist() == allowing(3).tolist()  # the step's mask is left as it was


def test_min_tokens_still_holds_back_a_stop_id_the_grammar_allows_beside_others():
    logits = logits_of(0, 0, 9, 0, 0, 1, 0, 0, 0, 0)[None].clone()
    row_ = SampleRow(SamplingParams(temperature=0, min_tokens=2), [], [1], (2,), None, allowing(2, 5))
    assert Sampler()(logits, [row_])[0] == [5]
    logits = logits_of(0, 0, 9, 0, 0, 1, 0, 0, 0, 0)[None].clone()
    row_ = SampleRow(SamplingParams(temperature=0, min_tokens=2), [], [1, 1], (2,), None, allowing(2, 5))
    assert Sampler()(logits, [row_])[0] == [2]  # min_tokens reached


def test_verify_takes_a_drafted_stop_id_the_grammar_forces_before_min_tokens():
    """Speculative verification samples each position as decoding does: a draft [5, 2]
    whose second position the grammar allows only the stop id 2 at is kept whole."""
    p = SamplingParams(temperature=0, min_tokens=6)
    logits = torch.zeros(3, V)
    logits[0, 5] = 1.0
    rows = [SampleRow(p, [], [1], (2,), None, allowing(5, 6)), SampleRow(p, [], [1, 5], (2,), None, allowing(2)),
            SampleRow(p, [], [1, 5, 2], (2,), None, None)]
    tokens, _ = Sampler().verify(logits, rows, [5, 2])
    assert tokens == [5, 2, 0]  # (the last row: min_tokens holds back 2, no grammar)


def test_logprobs_are_raw_log_softmax_with_rank():
    logits = logits_of(1.0, 3.0, 2.0, 0.0)
    sampler = Sampler()
    toks, lps = sampler(logits[None].clone(), [row(SamplingParams(temperature=0, logprobs=2))])
    ref = torch.log_softmax(logits, 0)
    lp = lps[0]
    assert toks == [1] and lp.sampled.token_id == 1 and lp.sampled.rank == 1
    assert math.isclose(lp.sampled.logprob, float(ref[1]), rel_tol=1e-6)
    assert [t.token_id for t in lp.top] == [1, 2]
    assert [t.rank for t in lp.top] == [1, 2]


def test_invalid_params_name_the_field():
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
                         ({"min_p": 1.5}, "min_p"), ({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"),
                         ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"presence_penalty": 3}, "presence"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"logprobs": 21}, "logprobs"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"stop": [""]}, "stop")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_logit_bias_is_added_before_sampling():
    sampler = Sampler()
    logits = logits_of(1.0, 3.0, 2.0)[None].clone()
    toks, _ = sampler(logits, [row(SamplingParams(temperature=0, logit_bias={0: 5.0, 1: -100}))])
    assert toks == [0]
    toks, _ = sampler(logits_of(1.0, 3.0, 2.0)[None].clone(), [row(SamplingParams(temperature=1.0,
                                                                                  logit_bias={1: -100, 2: -100}))])
    assert toks == [0]  # exp(-97) is negligible: the biased tokens are never drawn here
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def test_draw_follows_the_distribution_and_never_takes_a_zero():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(7)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    for i in (0, 2, 3):  # within 4.5 standard deviations of n * p
        sd = (n * probs[i] * (1 - probs[i])) ** 0.5
        assert abs(counts[i] - n * probs[i]) < 4.5 * sd, counts


def test_draw_at_the_top_of_the_range_takes_the_last_possible_token(monkeypatch):
    # a uniform that rounds up to the total mass must not land on the zero-probability tail
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert draw(torch.tensor([0.25, 0.75, 0.0, 0.0]), torch.Generator()) == 1
