"""Earlier requests' tokens, kept per cache scope, for speculative drafts (method "suffix").

A request that finishes adds its tokens (prompt and output) to the table of its cache
scope (`CacheScope.salt`: a gateway tenant's salt; None, the unsalted scope, for requests
without one, which share their prefix cache blocks too); a later request of the same scope
whose own tokens offer no draft looks its suffix n-gram up there (core/speculation.py). A
request never reads another scope's table, so no tenant's text is ever proposed to another
(and since drafts are verified, a draft never changes an answer either).

Bounded: a scope keeps its last `max_requests` requests and at most MAX_SCOPE_TOKENS tokens
(a lookup is a bytes.rfind over them), the table MAX_TABLE_TOKENS in all (16 MB, as
llama.cpp's n-gram table), the least recently used scope's oldest request out first; and
at most MAX_SCOPES scopes (each holds ~1 KB besides its words: without this bound, requests
of ever new salts would hold ~90 times the tokens' bytes), the least recently used out first.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_SCOPE_TOKENS = 1 << 18  # 1 MB of words: one lookup reads at most this
MAX_TABLE_TOKENS = 1 << 22  # 16 MB in all
MAX_SCOPES = 1 << 14  # scopes kept (~18 MB of their own at most)
WORD = 4
_ID_BITS = 7 * WORD  # ids 0 .. 2^28 - 2; the last code is the separator
_SEP_CODE = (1 << _ID_BITS) - 1


def _word(t: int) -> int:
    """One id's word as a big-endian integer (see `encode`)."""
    if t < 0 or t >= _SEP_CODE:
        t = _SEP_CODE
    return 0x80000000 | (t >> 21) << 24 | (t >> 14 & 0x7F) << 16 | (t >> 7 & 0x7F) << 8 | (t & 0x7F)


def encode(ids: Sequence[int]) -> bytes:
    """Token ids as WORD-byte words, 7 bits of the id a byte, most significant first, the
    first byte of a word marked by its high bit (and no other): a pattern of whole words
    can then occur in words only at a word boundary, so one bytes.rfind finds the latest
    whole-word occurrence (with plain int32 words, crafted ids matched at every byte and
    the search had to step back one misaligned match at a time). -1, and any id outside
    [0, 2^28 - 1) (none is: ids are checked against the vocabulary), encode as the separator.
    Plain struct packing: the scheduler encodes a token or two a step, where numpy's fixed
    cost per call (~20 us) was most of a proposal's cost."""
    return struct.pack(f">{len(ids)}I", *map(_word, ids))


def decode(words: bytes | bytearray) -> list[int]:
    """The ids of `encode`'s words (-1 for the separator)."""
    out = []
    for w in struct.unpack(f">{len(words) // WORD}I", words):
        u = (w >> 24 & 0x7F) << 21 | (w >> 16 & 0x7F) << 14 | (w >> 8 & 0x7F) << 7 | (w & 0x7F)
        out.append(-1 if u == _SEP_CODE else u)
    return out


SEPARATOR = encode([-1])


@dataclass
class _Scope:
    """One scope's requests (their lengths in words, oldest first) and their words, each
    request followed by SEPARATOR."""

    words: bytearray = field(default_factory=bytearray)
    lengths: deque[int] = field(default_factory=deque)


class SuffixTable:
    """Per cache scope, the tokens of its last requests. `add` mutates the scope's table
    (and may drop the oldest entries of any scope); `words` reads one."""

    def __init__(self, max_requests: int, max_scope_tokens: int = MAX_SCOPE_TOKENS,
                 max_tokens: int = MAX_TABLE_TOKENS, max_scopes: int = MAX_SCOPES) -> None:
        self.max_requests = max_requests
        self.max_scope_tokens = max_scope_tokens
        self.max_tokens = max_tokens
        self.max_scopes = max_scopes
        self._scopes: OrderedDict[str | None, _Scope] = OrderedDict()  # least recently used first
        self.num_tokens = 0  # words held in all, separators included

    def words(self, scope: str | None) -> bytes | bytearray:
        """The scope's earlier requests' tokens as words (b"" for a scope with none)."""
        s = self._scopes.get(scope)
        if s is None:
            return b""
        self._scopes.move_to_end(scope)
        return s.words

    def add(self, scope: str | None, words: bytes | bytearray) -> None:
        """Keep a finished request's tokens (as `encode`'s words) in its scope's table."""
        n = len(words) // WORD + 1
        if n > self.max_scope_tokens:
            words, n = words[-(self.max_scope_tokens - 1) * WORD:], self.max_scope_tokens
        s = self._scopes.setdefault(scope, _Scope())
        self._scopes.move_to_end(scope)
        s.words += words
        s.words += SEPARATOR
        s.lengths.append(n)
        self.num_tokens += n
        while len(s.lengths) > self.max_requests or len(s.words) // WORD > self.max_scope_tokens:
            self._drop_oldest(scope)
        while self.num_tokens > self.max_tokens or len(self._scopes) > self.max_scopes:
            self._drop_oldest(next(iter(self._scopes)))

    def _drop_oldest(self, scope: str | None) -> None:
        s = self._scopes[scope]
        n = s.lengths.popleft()
        del s.words[:n * WORD]
        self.num_tokens -= n
        if not s.lengths:
            del self._scopes[scope]
