"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of ids (prefix/read offsets) so that a
character split over several byte tokens appears only once complete, and a
word-initial space is kept. Stop strings are searched in the text; while a
request runs, the last (longest stop - 1) characters are held back so a
streamed delta never contains the start of a stop string.
"""

from __future__ import annotations

from typing import Any

from hotprefix.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5  # prompt tokens used as left context for the first output tokens


class IncrementalDetokenizer:
    """Accumulates output text for one sequence. Mutated by `append`."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0  # characters of text already handed out as deltas
        self.num_output_tokens = 0
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Add one token. Returns the stop string that now ends the text, or None.
        On a stop, text is cut just before the stop string (or after it with
        include_stop_str_in_output)."""
        self.ids.append(token_id)
        self.num_output_tokens += 1
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self.num_output_tokens >= self.params.min_tokens:
                return self._check_stop(start)
        return None

    def _check_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        return s

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, minus the held-back tail."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
