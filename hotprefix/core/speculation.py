"""Speculative decoding without a draft model: prompt-lookup (n-gram) drafts.

Owned by the scheduler (engine thread). Before a step, a running request that is
decoding gets a draft: the longest suffix n-gram of its own tokens (prompt and output
so far; n from prompt_lookup_max down to prompt_lookup_min) is looked for earlier in
them, its latest earlier occurrence wins, and up to k tokens that followed it are
proposed. The step computes the request's last token and the draft as one chunk
through the paged KV (k + 1 positions scored at once); the runner samples position by
position with the request's own generator and keeps the draft while each sample equals
the draft token (model/sampler.Sampler.verify), so the tokens are exactly those decoding
one at a time would give. The scheduler then keeps the accepted tokens and releases the
KV blocks of the rejected tail (KVCacheManager.trim).

Adaptive, per request: the draft length follows acceptance (a draft taken whole lets
the next be one longer, up to k; one taken in part proposes one more than was taken
next time); a draft of which nothing is taken leaves a request that has kept at least
PAYING of its draft tokens as it was (its drafts pay for their misses), and otherwise
makes the next one a single token, after the request waits 1, 2, 4 ... up to MAX_BACKOFF
steps; a request that has taken nothing after GIVE_UP drafts stops proposing.

A request with an output constraint (a grammar) drafts first the tokens its grammar forces
next (llguidance's fast-forward tokens: a schema's keys and punctuation; up to k of them),
then the n-gram draft of its tokens followed by those (its adaptive length, up to k: so a
constrained draft is up to 2k tokens, SpeculativeConfig.max_draft_tokens, and the forced
tokens, almost always kept, take nothing from the n-gram part; its n-gram part looks up
single-token matches too, CONSTRAINED_LOOKUP_MIN), cut before the first token
its grammar would reject next (`GrammarDrafts`: the runner's matchers, not moved; the one
validation of a draft against its grammar before the step); the runner samples each drafted
position under the grammar's mask there (model/drafts.py), so the tokens are those
constrained decoding gives one at a time. The forced tokens are the forced bytes in the
tokenizer's canonical tokenization, so they are drafts like any other (the model may say
the same bytes in other tokens), but they are proposed whatever the adaptive state (the
back-off waits, the length, giving up: those follow the n-gram tokens alone), until a
forced token of the request is rejected: from then on its forced tokens count as n-gram
tokens.

Tokens are kept per request as 4-byte words in a bytearray (suffix_table.encode: a
marked first byte, so whole words match only on word boundaries), so a search is one
bytes.rfind (C speed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hotprefix.config import SpecMethod, SpeculativeConfig
from hotprefix.core.request import Request
from hotprefix.core.suffix_table import WORD, SuffixTable, decode, encode

MAX_BACKOFF = 64  # the most steps a request that took nothing waits before it proposes again
GIVE_UP = 8  # drafts after which a request that never took a token stops proposing
PAYING = 0.125  # a request that kept at least this share of its draft tokens does not back off: a
# draft token costs ~0.15 of a decode step and a kept one saves a step (docs/benchmarks.md, spec_oracle)
CONSTRAINED_LOOKUP_MIN = 1  # the shortest n-gram a constrained request's draft looks up, whatever
# prompt_lookup_min says: under a grammar a one-token match is kept often enough to pay (the json
# workload: 1.56-1.63x -> 1.80-1.84x, docs/benchmarks.md); only the speed changes, never the tokens

class GrammarDrafts(Protocol):
    """What the Speculator asks of a constrained request's grammar, its matcher not moved
    (model/structured.GrammarMatchers)."""

    def forced_tokens(self, request_id: str) -> list[int]:
        """The tokens the request's grammar forces next ([] for none)."""

    def accepted_prefix(self, request_id: str, tokens: list[int]) -> int:
        """How many of `tokens`' first tokens the request's grammar accepts next."""


def latest(haystack: bytes | bytearray, pattern: bytes, end: int) -> int:
    """The word index of the latest occurrence of `pattern` (whole `encode`d words) in
    haystack[:end] (bytes), or -1: only a word's first byte is marked, so any match is on
    a word boundary."""
    at = haystack.rfind(pattern, 0, end)
    return at // WORD if at >= 0 else -1


def following(haystack: bytes | bytearray, start: int, k: int) -> list[int]:
    """Up to k tokens from word `start` on, ending before a separator (-1) or the end."""
    tokens = decode(haystack[start * WORD:(start + k) * WORD])
    return tokens[:tokens.index(-1)] if -1 in tokens else tokens


def find_draft(words: bytes | bytearray, min_n: int, max_n: int, k: int,
               table: bytes | bytearray = b"") -> list[int]:
    """The draft for the tokens in `words` (WORD-byte words): the tokens after the latest
    earlier occurrence of the longest suffix n-gram (min_n <= n <= max_n) that occurs
    earlier, at most k of them (fewer where the context ends first); at each n, where the
    context has none, the tokens after its latest occurrence in `table` (earlier requests'
    tokens, a separator between them); [] without a match."""
    count = len(words) // WORD
    for n in range(min(max_n, count - 1), min_n - 1, -1):
        pattern = bytes(words[(count - n) * WORD:])
        at = latest(words, pattern, (count - 1) * WORD)  # an occurrence ending before the last token
        if at >= 0:
            return following(words, at + n, min(k, count - at - n))
        at = latest(table, pattern, len(table)) if table else -1
        if at >= 0 and (draft := following(table, at + n, k)):
            return draft
    return []


@dataclass
class SpecStats:
    """Counters since the last read (vLLM's spec_decode metrics): drafts proposed and
    verified, their tokens, the tokens accepted, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class _Draft:
    """One request's buffer (its tokens so far as words) and its adaptive state."""

    k: int
    words: bytearray = field(default_factory=bytearray)
    num_words: int = 0
    wait: int = 0  # steps to skip before the next proposal
    backoff: int = 1
    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    forced: int = 0  # the last draft's first tokens that its grammar forced, outside the adaptive rules
    trust_forced: bool = True  # False once a forced token was rejected: they count as n-gram tokens


class Speculator:
    """Proposes drafts (`propose`) and learns from their verification (`observe`).
    Mutates only its own per-request state, counters and suffix table; `finished` drops a request's state."""

    def __init__(self, config: SpeculativeConfig, grammar: GrammarDrafts | None = None) -> None:
        self.config = config
        self.grammar = grammar  # None: requests with an output constraint do not draft
        self._states: dict[str, _Draft] = {}
        self.table = SuffixTable(config.suffix_decoding_max_cached_requests) \
            if config.method is SpecMethod.SUFFIX else None  # earlier requests' tokens, per cache scope
        self._stats = SpecStats(accepted_per_pos=[0] * config.max_draft_tokens)

    def propose(self, req: Request) -> list[int]:
        """The draft for a running request that decodes next (its last token is its only
        uncomputed one), within its max_tokens and max_model_len, and within what its
        grammar accepts: a constrained request's forced tokens (up to k) and then its n-gram
        tokens (up to its adaptive length), so up to 2k tokens; [] when it may not or need
        not propose."""
        constrained = req.sampling_params.structured is not None
        if (constrained and self.grammar is None) or req.num_output_tokens == 0 \
                or req.num_computed_tokens != req.num_tokens - 1:
            return []
        st = self._states.get(req.request_id)
        if st is None:
            st = self._states[req.request_id] = _Draft(self.config.num_speculative_tokens)
        idle = st.wait > 0 or st.k == 0
        if idle:
            st.wait = max(0, st.wait - 1)
            if not (constrained and st.trust_forced):
                return []
        room = self.config.max_draft_tokens
        if req.sampling_params.max_tokens is not None:
            room = min(room, req.sampling_params.max_tokens - req.num_output_tokens - 1)
        if req.max_model_len is not None:
            room = min(room, req.max_model_len - req.num_tokens - 1)
        forced = self.grammar.forced_tokens(req.request_id)[:min(room, self.config.num_speculative_tokens)] \
            if constrained and room > 0 else []
        st.forced = len(forced) if st.trust_forced else 0
        size = min(room, st.forced + (0 if idle else st.k))  # untrusted forced tokens: within st.k
        draft = forced[:size]
        if len(draft) < size:
            self._extend(st, req)
            table = self.table.words(req.cache_scope.salt) if self.table is not None else b""
            words = st.words + encode(draft) if draft else st.words
            least = min(self.config.prompt_lookup_min, CONSTRAINED_LOOKUP_MIN) if constrained \
                else self.config.prompt_lookup_min
            draft += find_draft(words, least, self.config.prompt_lookup_max, size - len(draft), table)
        return draft[:self.grammar.accepted_prefix(req.request_id, draft)] if constrained and draft else draft

    @staticmethod
    def _extend(st: _Draft, req: Request) -> None:
        """Append the request's tokens not yet in its buffer."""
        p = req.num_prompt_tokens
        if st.num_words < p:
            st.words += encode(req.prompt_token_ids[st.num_words:])
            st.num_words = p
        st.words += encode(req.output_token_ids[st.num_words - p:])
        st.num_words = req.num_tokens

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A draft of `proposed` tokens was verified and `accepted` of them kept: count it
        and set the request's next draft length (see the module's docstring)."""
        s = self._stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for pos in range(accepted):
            s.accepted_per_pos[pos] += 1
        st = self._states.get(request_id)
        if st is None:
            return
        forced, st.forced = min(st.forced, proposed), 0
        if accepted < forced:
            st.trust_forced = False  # the model says the forced bytes in other tokens
        elif forced:  # the n-gram tokens after the forced ones (the adaptive rules' own)
            proposed, accepted = proposed - forced, accepted - forced
            if proposed == 0:
                return
        st.drafts += 1
        st.proposed += proposed
        st.accepted += accepted
        if accepted == proposed:
            st.k = min(self.config.num_speculative_tokens, st.k + 1)
        elif accepted > 0:
            st.k = accepted + 1
        if accepted > 0:
            st.backoff = 1
            return
        if st.accepted >= PAYING * st.proposed:
            return  # its drafts pay for their misses: the next one at once, as long
        st.k = 1  # a rejected draft costs about its rows: the next tries one token
        st.wait, st.backoff = st.backoff, min(MAX_BACKOFF, st.backoff * 2)
        if st.accepted == 0 and st.drafts >= GIVE_UP:
            st.k = 0  # it never took a token: it stops paying for drafts

    def finished(self, req: Request) -> None:
        """The request finished: its tokens go to its scope's suffix table (method
        "suffix"); its buffer and state are dropped."""
        st = self._states.pop(req.request_id, None)
        if self.table is not None:
            st = st or _Draft(0)
            self._extend(st, req)
            self.table.add(req.cache_scope.salt, st.words)

    def make_stats(self) -> SpecStats:
        """The counters since the last call (then reset)."""
        s, self._stats = self._stats, SpecStats(accepted_per_pos=[0] * self.config.max_draft_tokens)
        return s
