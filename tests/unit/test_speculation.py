"""Prompt-lookup speculation in the core (no model): the n-gram search (vLLM's cases and
a reference search), the adaptive draft length, and the scheduler's side of a verified
draft: blocks for the draft, the rejected tail's blocks released, stops inside a draft."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotprefix.config import ConfigError, EngineConfig, SchedulerConfig, SpecMethod, SpeculativeConfig
from hotprefix.core.hashing import CacheScope
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.outputs import ModelRunnerOutput
from hotprefix.core.request import RequestStatus
from hotprefix.core.scheduler import Scheduler
from hotprefix.core.speculation import CONSTRAINED_LOOKUP_MIN, GIVE_UP, Speculator, find_draft
from hotprefix.core.suffix_table import MAX_SCOPES, WORD, SuffixTable, decode, encode
from hotprefix.sampling_params import StructuredKind, StructuredOutput
from tests.unit.builders import make_request

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return find_draft(bytearray(encode(tokens)), min_n, max_n, k)


def reference_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same rule, searched as lists: the longest suffix n-gram found earlier, its latest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_vllms_cases():
    assert draft([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2) == []
    assert draft([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert draft([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert draft([1, 2, 3, 4, 1, 2, 3], 1, 1, 3) == [4, 1, 2]
    assert draft([1, 2, 3, 4, 1, 2, 3], 1, 3, 5) == [4, 1, 2, 3]  # the context ends first


def test_the_longest_ngram_then_the_latest_occurrence_wins():
    assert draft([5, 1, 2, 9, 3, 1, 2, 8, 5, 1, 2], 1, 3, 2) == [9, 3]  # [5, 1, 2] beats the later [1, 2]
    assert draft([7, 1, 9, 7, 1, 8, 7, 1], 2, 2, 2) == [8, 7]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 127, 128, 255, 256, 257, 16383, 16384, 65536, 2**21, 2**21 + 1, 2**28 - 2]),
                max_size=40),
       st.integers(1, 4), st.integers(0, 3), st.integers(1, 6))
def test_the_byte_search_is_the_list_search(tokens, min_n, extra, k):
    """Ids whose 7-bit groups repeat across word boundaries must not match there."""
    assert draft(tokens, min_n, min_n + extra, k) == reference_draft(tokens, min_n, min_n + extra, k)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**28 - 2), min_size=1, max_size=30), st.data())
def test_whole_words_occur_only_on_word_boundaries(tokens, data):
    """Why one rfind is enough (the old int32 words made crafted ids match at every byte,
    and the search stepped back one misaligned match at a time: 0.2-0.35 s a draft on a
    1 MiB context, on the engine thread): every occurrence of a run of whole words, found
    byte by byte, starts on a word boundary, and the words decode to the ids."""
    words = encode(tokens)
    assert decode(words) == tokens and len(words) == WORD * len(tokens)
    a = data.draw(st.integers(0, len(tokens) - 1))
    pattern = encode(tokens[a:data.draw(st.integers(a + 1, len(tokens)))])
    at = words.find(pattern)
    while at >= 0:
        assert at % WORD == 0
        at = words.find(pattern, at + 1)


def test_ids_out_of_range_are_separators():
    """No id is outside the vocabulary (checked at admission); were one, it ends a draft
    instead of raising on the engine thread or matching another id."""
    assert decode(encode([5, -1, 2**28 - 1, 2**40, 6])) == [5, -1, -1, -1, 6]
    assert draft([3, 2**40, 3, 9, 3], 1, 1, 3) == [9, 3]


def decoding(tokens_out: list[int], prompt: list[int], max_tokens: int = 100, **kw):
    req = make_request("r", 0, prompt=prompt, max_tokens=max_tokens, **kw)
    req.output_token_ids = list(tokens_out)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_the_draft_length_follows_acceptance_and_a_request_that_takes_nothing_waits():
    spec = Speculator(SPEC)
    req = decoding([1, 2], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5])
    assert spec.propose(req) == [3, 4, 5]
    spec.observe("r", 3, 1)
    assert spec.propose(req) == [3, 4]  # one more than was taken
    spec.observe("r", 2, 2)
    assert (d := spec.propose(req)) == [3, 4, 5]  # taken whole: one longer, up to k
    lengths = []
    for _ in range(6):  # 3 kept of 8, 11 ... 23 draft tokens: at least PAYING (1/8), its drafts pay for misses
        spec.observe("r", len(d), 0)
        lengths.append(len(d := spec.propose(req)))
    assert lengths == [3] * 6  # no wait, the same length
    waits, lengths = [], []
    for _ in range(GIVE_UP - 2):  # 3 of 26: under PAYING
        spec.observe("r", len(d), 0)
        skipped = 0
        while not (d := spec.propose(req)):
            skipped += 1
        waits.append(skipped)
        lengths.append(len(d))
    assert waits == [1, 2, 4, 8, 16, 32] and lengths == [1] * 6  # after nothing taken: wait, then one token
    spec.observe("r", 1, 1)  # taken: the waits end, the length grows again
    assert spec.propose(req) == [3, 4]
    stats = spec.make_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (GIVE_UP + 7, 3 + 2 + 3 * 7 + 1 * (GIVE_UP - 2), 4, [3, 1, 0, 0, 0, 0])  # 2k positions
    assert spec.make_stats().num_drafts == 0  # reset on read


def test_a_request_that_never_accepts_stops_proposing():
    spec = Speculator(SPEC)
    req = decoding([1, 2], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5])
    proposals = 0
    for _ in range(10_000):
        if d := spec.propose(req):
            proposals += 1
            spec.observe("r", len(d), 0)
    assert proposals == GIVE_UP


def test_no_draft_past_max_tokens_or_max_model_len_nor_under_a_grammar():
    spec = Speculator(SPEC)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    assert spec.propose(decoding([1, 2], prompt, max_tokens=4)) == [3]  # 2 + 1 drafted + 1 sampled = 4
    assert spec.propose(decoding([1, 2], prompt, max_tokens=3)) == []
    capped = decoding([1, 2], prompt)
    capped.max_model_len = capped.num_tokens + 3
    assert spec.propose(capped) == [3, 4]
    json = StructuredOutput(StructuredKind.JSON_OBJECT)
    assert spec.propose(decoding([1, 2], prompt, structured=json)) == []
    prefill = decoding([], prompt)
    assert spec.propose(prefill) == []  # its first token is sampled by the prompt's step


class Forcing:
    """A grammar (GrammarDrafts) that forces `forced` next and takes a draft's first
    `takes` tokens (None: all); `seen` records the drafts it was asked about."""

    def __init__(self, forced: list[int], takes: int | None = None) -> None:
        self.forced, self.takes = forced, takes
        self.seen: list[tuple[str, list[int]]] = []

    def forced_tokens(self, request_id: str) -> list[int]:
        return list(self.forced)

    def accepted_prefix(self, request_id: str, tokens: list[int]) -> int:
        self.seen.append((request_id, tokens))
        return len(tokens) if self.takes is None else self.takes


def test_a_grammars_forced_tokens_are_drafted_first_outside_the_adaptive_rules():
    """The forced tokens (up to k), then the n-gram draft of the tokens followed by them (up
    to its own adaptive length, so up to 2k in all); the back-off waits and the length follow
    the n-gram tokens alone, until a forced token is rejected (the model says those bytes in
    other tokens): then they count as n-gram tokens, within the n-gram's length."""
    json = StructuredOutput(StructuredKind.JSON_OBJECT)
    spec = Speculator(SPEC, Forcing([7, 8]))
    req = decoding([4, 5], [1, 2, 3, 7, 8, 9, 6, 5], structured=json)
    assert spec.propose(req) == [7, 8, 9, 6, 5]  # [7, 8] forced, then k = 3 after the earlier [7, 8]
    spec.observe("r", 5, 2)  # the n-gram's tokens rejected: its back-off starts (wait 1, then one token)
    assert spec.propose(req) == [7, 8]  # waiting: the forced tokens alone
    spec.observe("r", 2, 2)  # nothing of the n-gram's: the adaptive state does not move
    assert spec.propose(req) == [7, 8, 9]
    spec.observe("r", 3, 1)  # a forced token rejected: from now on they are n-gram tokens
    assert spec.propose(req) == [7, 8]  # one more than was taken
    spec.observe("r", 2, 0)  # 1 kept of 8 draft tokens: PAYING, no wait
    assert spec.propose(req) == [7, 8]
    spec.observe("r", 2, 0)  # 1 of 10: under PAYING
    assert spec.propose(req) == []  # the back-off's wait applies to them now
    assert spec.propose(req) == [7]
    stats = spec.make_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (5, 14, 5, [3, 2, 0, 0, 0, 0])
    capped = Speculator(SPEC, Forcing([7, 8]))
    assert capped.propose(decoding([4, 5], [1, 2, 3, 7, 8, 9, 6, 5], structured=json, max_tokens=4)) == [7]
    assert capped.propose(decoding([4, 5], [1, 2, 3, 7, 8, 9, 6, 5], structured=json, max_tokens=3)) == []


def test_a_forced_run_beyond_k_drafts_k_of_it_then_the_ngrams_within_the_room():
    """A forced run longer than k: its first k tokens, then the n-gram's k after them
    (2k in all, the accepted-per-position counter's size); max_tokens cuts the n-gram's
    part first, then the forced run."""
    json = StructuredOutput(StructuredKind.JSON_OBJECT)
    prompt = [1, 2, 3, 7, 8, 9, 6, 5, 4, 3]
    spec = Speculator(SPEC, Forcing([7, 8, 9, 6]))
    assert spec.propose(decoding([4, 5], prompt, structured=json)) == [7, 8, 9, 6, 5, 4]
    spec.observe("r", 6, 6)
    assert spec.make_stats().accepted_per_pos == [1] * 6
    for max_tokens, want in ((7, [7, 8, 9, 6]), (5, [7, 8]), (3, [])):
        capped = Speculator(SPEC, Forcing([7, 8, 9, 6]))
        assert capped.propose(decoding([4, 5], prompt, structured=json, max_tokens=max_tokens)) == want


def test_forced_tokens_are_drafted_after_the_ngram_gave_up_and_never_without_a_grammar():
    json = StructuredOutput(StructuredKind.JSON_OBJECT)
    spec = Speculator(SPEC, Forcing([7]))
    req = decoding([4, 5], [1, 2, 7, 6, 9], structured=json)
    proposals = 0
    for _ in range(10_000):
        d = spec.propose(req)
        assert d[:1] == [7]
        proposals += len(d) > 1
        spec.observe("r", len(d), 1)  # the forced token taken, never the n-gram's
    assert proposals == GIVE_UP  # the n-gram gave up; the forced token is still drafted
    assert Speculator(SPEC, Forcing([7])).propose(decoding([6, 9], [1, 6, 9, 2])) == [2, 6, 9]  # no constraint


def test_a_constrained_request_looks_up_single_tokens_whatever_prompt_lookup_min_says():
    """prompt_lookup_min 2: an unconstrained request whose last token alone occurs earlier
    drafts nothing; the same tokens under a grammar draft what followed that token
    (CONSTRAINED_LOOKUP_MIN), after its forced tokens, and a 2-gram match still wins."""
    spec2 = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
    json = StructuredOutput(StructuredKind.JSON_OBJECT)
    prompt, out = [1, 5, 6, 7, 2, 3], [4, 5]  # 5 occurs earlier, the 2-gram (4, 5) does not
    assert Speculator(spec2, Forcing([])).propose(decoding(out, prompt)) == []
    assert Speculator(spec2, Forcing([])).propose(decoding(out, prompt, structured=json)) == [6, 7, 2]
    assert Speculator(spec2, Forcing([9])).propose(decoding(out, [5, 9, 1, 2, 9, 3, 3, 7], structured=json)) \
        == [9, 1, 2, 9]  # forced 9, then what followed (5, 9), not what followed the latest 9 alone (3, 3, 7)
    assert CONSTRAINED_LOOKUP_MIN == 1


def test_the_speculative_config_is_vllms_json():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 4, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)
    for bad, why in [('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
                     ('{"method": "ngram"}', "num_speculative_tokens is required"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown key(s) model"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                      '"prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
                     ("ngram", "must be a JSON object")]:
        with pytest.raises(ConfigError) as e:
            SchedulerConfig(speculative_config=bad)
        assert why in str(e.value)
    assert SchedulerConfig().speculative_config is None


def spec_scheduler(num_blocks: int = 16) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=64, speculative_config=SPEC)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), 0)


def start(s: Scheduler, prompt: list[int], first: int, **kw):
    """Add a request, run its prompt (sampling `first`) and return it."""
    req = make_request("r", 0, prompt=prompt, **kw)
    s.add_request(req)
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"r": first}))
    s.check_integrity()
    return req


def step(s: Scheduler, sampled: int, kept: list[int] | None = None):
    """One step that samples `sampled` after keeping `kept` of the draft; (scheduled, output)."""
    out = s.schedule()
    (o,) = s.update(out, ModelRunnerOutput({"r": sampled}, accepted_token_ids={"r": kept} if kept else {}))
    s.check_integrity()  # after every step: no block leaked, none held twice
    return out.requests[0], o


def test_a_verified_draft_keeps_the_accepted_tokens_and_releases_the_rejected_tails_blocks():
    s = spec_scheduler()
    req = start(s, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1], first=2, max_tokens=20)
    out = s.schedule()  # [.. 7, 1, 2]: [7, 1, 2] at 6 -> [3, 4, 5]
    (sr,) = out.requests
    assert (sr.token_ids, sr.draft_token_ids, sr.start_pos, sr.sample) == ([2, 3, 4, 5], [3, 4, 5], 15, True)
    assert len(s.kv.block_ids("r")) == 5 and out.num_prefill_decode_tokens() == (0, 4)  # positions 15..18
    s.update(out, ModelRunnerOutput({"r": 9}))  # nothing kept: position 15's token is 9
    s.check_integrity()
    assert req.output_token_ids == [2, 9] and req.num_computed_tokens == 16 and len(s.kv.block_ids("r")) == 4
    sr, _ = step(s, 4)
    assert sr.draft_token_ids == []  # it waits a step after a draft of which nothing was kept
    sr, o = step(s, 6, kept=[5])  # [.. 9, 4]: [4] at 10 -> [5]: one token after a rejected draft; kept
    assert (sr.draft_token_ids, sr.start_pos) == ([5], 17)
    sr, o = step(s, 1, kept=[7])  # [.. 4, 5, 6] at 3 -> [7, 1]: 7 kept, then 1 sampled
    assert (sr.draft_token_ids, sr.start_pos) == ([7, 1], 19)
    assert o.new_token_ids == [7, 1] and req.output_token_ids == [2, 9, 4, 5, 6, 7, 1]
    assert req.num_computed_tokens == 21 and len(s.kv.block_ids("r")) == 6  # positions 19-21 took a sixth
    stats = s.make_stats().spec
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (3, 6, 2, [2, 0, 0, 0, 0, 0])
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert s.kv.pool.num_free_blocks == 16 and s.spec._states == {}


def test_a_stop_inside_a_draft_ends_the_request_there():
    s = spec_scheduler()
    req = start(s, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], first=4, max_tokens=20, stop_token_ids=[2])
    sr, o = step(s, 3, kept=[5, 1, 2])  # [2, 3, 4] at 6 -> [5, 1, 2]: all kept, but 2 stops it
    assert sr.draft_token_ids == [5, 1, 2]
    assert (o.new_token_ids, o.finished_status, o.stop_reason) == ([5, 1, 2], RequestStatus.FINISHED_STOPPED, 2)
    assert req.output_token_ids == [4, 5, 1, 2] and s.requests == {} and s.kv.pool.num_free_blocks == 16


def test_a_draft_stops_at_max_tokens():
    s = spec_scheduler()
    req = start(s, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], first=4, max_tokens=3)
    sr, o = step(s, 7, kept=[5])  # 1 drafted + 1 sampled reach max_tokens
    assert sr.draft_token_ids == [5] and o.new_token_ids == [5, 7]
    assert o.finished_status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [4, 5, 7]


def test_a_draft_without_room_for_its_blocks_decodes_one_token():
    s = spec_scheduler(num_blocks=4)
    req = start(s, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1], first=2, max_tokens=20)
    sr, _ = step(s, 3)  # 16 tokens fill 4 blocks: a draft would need a fifth
    assert sr.draft_token_ids == [] and sr.token_ids == [2] and req.num_preemptions == 0


def test_speculation_is_off_unless_configured():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(16, 4), 0)
    assert s.spec is None
    start(s, [1, 2, 3, 1, 2, 3, 1, 2], first=3, max_tokens=5)
    sr, _ = step(s, 1)
    assert sr.token_ids == [3] and sr.draft_token_ids == [] and s.make_stats().spec is None


@pytest.mark.parametrize("command", [["serve"], ["generate", "hello"]])
def test_the_flag_and_the_llm_keyword_mean_the_same(command):
    from hotprefix.cli import build_parser, engine_config_from_args, serve_flags
    from hotprefix.flags import build, take_keywords
    from hotprefix.vllm_flags import expand_config

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    parser = build_parser()
    a = parser.parse_args(expand_config([*command, "--speculative-config", text], serve_flags(parser)))
    kwargs = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}}
    from_keyword = build(EngineConfig, take_keywords(kwargs, EngineConfig))
    assert engine_config_from_args(a).scheduler.speculative_config == from_keyword.scheduler.speculative_config == SPEC
    with pytest.raises(ConfigError, match="method 'eagle' is not supported"):
        engine_config_from_args(parser.parse_args([*command, "--speculative-config",
                                                   '{"method": "eagle", "num_speculative_tokens": 3}']))


def test_the_suffix_table_keeps_a_scopes_last_requests_within_its_bounds():
    table = SuffixTable(max_requests=2, max_scope_tokens=10, max_tokens=14)

    def words(*ids: int) -> bytes:
        return encode(ids)

    table.add("a", words(1, 2, 3))
    table.add("a", words(4, 5))
    table.add("a", words(6))  # a third request: the first goes
    assert table.words("a") == words(4, 5, -1, 6, -1) and table.num_tokens == 5
    table.add("b", words(7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18))  # over the scope's 10: its tail kept
    assert table.words("b") == words(10, 11, 12, 13, 14, 15, 16, 17, 18, -1)
    assert table.words("a") == words(6, -1)  # 15 in all, over 14: the least recently used scope's oldest went
    assert table.num_tokens == 12
    table.add(None, words(1, 2, 3))  # 16: b (read before a) drops its one request, and with it the scope
    assert table.words(None) == words(1, 2, 3, -1) and table.words("b") == b"" and table.num_tokens == 6
    assert table.words("c") == b""


def test_the_suffix_table_holds_a_bounded_number_of_scopes():
    """Each scope costs memory besides its words (~1 KB: its buffer, its deque, its key):
    requests of ever new salts (one each) cannot grow the table past MAX_SCOPES scopes."""
    small = SuffixTable(max_requests=4, max_scopes=3)
    for i in range(5):
        small.add(f"s{i}", encode([i]))
    assert [small.words(f"s{i}") for i in range(5)] == [b"", b""] + [encode([i, -1]) for i in (2, 3, 4)]
    assert small.num_tokens == 6
    table = SuffixTable(max_requests=4)
    for i in range(MAX_SCOPES + 1):  # (the least recently used scope goes first)
        table.add(f"salt-{i}", encode([7, 8]))
    assert table.words("salt-0") == b"" and table.words("salt-1") == encode([7, 8, -1])
    assert table.num_tokens == 3 * MAX_SCOPES


def finished(spec: Speculator, rid: str, tokens: list[int], salt: str | None) -> None:
    req = make_request(rid, 0, prompt=tokens[:3], cache_scope=CacheScope(salt))
    req.output_token_ids = tokens[3:]
    spec.finished(req)


def test_suffix_drafts_come_from_earlier_requests_of_the_same_scope_only():
    spec = Speculator(SpeculativeConfig(SpecMethod.SUFFIX, 3, 2, 2))
    finished(spec, "a", [50, 51, 52, 53, 54, 55], "tenant-1")
    finished(spec, "b", [60, 61, 62, 63, 64], None)

    def draft_for(salt: str | None, out: list[int]) -> list[int]:
        req = make_request(f"q{salt}{out}", 0, prompt=[9, 8, 7], cache_scope=CacheScope(salt), max_tokens=50)
        req.output_token_ids = out
        req.num_computed_tokens = req.num_tokens - 1
        return spec.propose(req)

    assert draft_for("tenant-1", [51, 52]) == [53, 54, 55]
    assert draft_for("tenant-2", [51, 52]) == []  # another tenant's text is never proposed
    assert draft_for(None, [51, 52]) == []
    assert draft_for(None, [61, 62]) == [63, 64]  # the unsalted scope's own (as its prefix cache blocks)
    assert draft_for("tenant-1", [61, 62]) == []
    assert draft_for("tenant-1", [54, 55]) == []  # the end of a request: nothing follows it
    ngram = Speculator(SpeculativeConfig(SpecMethod.NGRAM, 3, 2, 2))
    assert ngram.table is None


def test_the_suffix_method_in_vllms_json():
    c = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 4,
                                 "suffix_decoding_max_cached_requests": 100})
    assert (c.method, c.suffix_decoding_max_cached_requests) == (SpecMethod.SUFFIX, 100)
    assert SpeculativeConfig.parse(c.to_json()) == c
    with pytest.raises(ConfigError, match="unknown key"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "suffix_decoding_max_cached_requests": 100})


def test_the_scheduler_feeds_finished_requests_to_their_scopes_suffix_table():
    cfg = SchedulerConfig(max_num_batched_tokens=64, speculative_config=SpeculativeConfig(SpecMethod.SUFFIX, 3, 2, 2))
    s = Scheduler(cfg, KVCacheManager(16, 4), 0)
    s.add_request(make_request("a", 0, prompt=[40, 41, 42, 43, 44, 45], cache_scope=CacheScope("t"), max_tokens=1))
    s.update(out := s.schedule(), ModelRunnerOutput({"a": 46}))
    assert out.requests[0].sample and s.requests == {}
    for rid, salt, want in [("b", "t", [43, 44, 45]), ("c", "u", [])]:
        s.add_request(make_request(rid, 0, prompt=[9, 41], cache_scope=CacheScope(salt), max_tokens=9))
        s.update(s.schedule(), ModelRunnerOutput({rid: 42}))
        assert s.schedule().requests[0].draft_token_ids == want
        s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        s.check_integrity()


def test_a_constrained_requests_draft_is_cut_where_its_grammar_stops_taking_it():
    grammar = Forcing([], takes=1)
    spec = Speculator(SPEC, grammar)
    json = StructuredOutput(StructuredKind.JSON_OBJECT)
    assert spec.propose(decoding([1, 2], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5], structured=json)) == [3]
    assert grammar.seen == [("r", [3, 4, 5])]
    assert spec.propose(decoding([1, 2], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5])) == [3, 4, 5]  # unconstrained: whole
    assert grammar.seen == [("r", [3, 4, 5])]
