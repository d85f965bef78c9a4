"""OpenAI's response shapes for /v1/completions and /v1/chat/completions: choices
(streamed and final) and logprob blocks. One streamed-choice loop serves both
endpoints; they differ in how a piece of text and a logprob block are written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hotprefix.engine.llm_engine import CompletionOutput, RequestOutput
from hotprefix.sampling_params import TokenLogprobs


class ChoiceFormat:
    """The choices of one response. token_text: a token id's text; top: alternatives
    per logprob entry; logprobs: whether the client asked for logprobs. Streaming
    keeps per-sample text offsets (for completions' text_offset)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, token_text: Callable[[int], str], top: int, logprobs: bool) -> None:
        self.token_text = token_text
        self.top = top
        self.logprobs = logprobs
        self._emitted: dict[tuple[int, int], int] = {}

    def piece(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def logprob_block(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        raise NotImplementedError

    def head(self, n: int) -> list[dict[str, Any]] | None:
        """The choices of a first chunk sent before any token (None: no such chunk)."""
        return None

    def stream_choices(self, i: int, out: RequestOutput, n: int) -> list[dict[str, Any]]:
        """The choices one step adds to prompt i's n samples (none for a sample with nothing new)."""
        choices = []
        for j, o in enumerate(out.outputs):
            new = out.new_token_ids[j]
            if not new and not out.deltas[j] and not (out.finished and o.finished):
                continue
            c: dict[str, Any] = {"index": i * n + j, **self.piece(out.deltas[j]), "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}
            if self.logprobs and new:
                c["logprobs"] = self.logprob_block((o.logprobs or [])[-len(new):], self._emitted.get((i, j), 0))
            self._emitted[(i, j)] = self._emitted.get((i, j), 0) + len(out.deltas[j])
            if out.finished:
                c["finish_reason"], c["stop_reason"] = o.finish_reason, o.stop_reason
            choices.append(c)
        return choices

    def final_choice(self, index: int, o: CompletionOutput, prefix: str = "") -> dict[str, Any]:
        """A non-streamed choice; prefix: the echoed prompt (completions)."""
        return {"index": index, **self.whole(prefix + o.text),
                "logprobs": self.logprob_block(o.logprobs or [], len(prefix)) if self.logprobs else None,
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}

    def whole(self, text: str) -> dict[str, Any]:
        return self.piece(text)


class CompletionFormat(ChoiceFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def piece(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def logprob_block(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        toks = [self.token_text(lp.sampled.token_id) for lp in lps]
        offsets, pos = [], offset
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": toks, "token_logprobs": [lp.sampled.logprob for lp in lps],
                "top_logprobs": [{self.token_text(a.token_id): a.logprob for a in lp.top[:self.top]} for lp in lps],
                "text_offset": offsets}


class ChatFormat(ChoiceFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def piece(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}}

    def whole(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def head(self, n: int) -> list[dict[str, Any]]:
        return [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for j in range(n)]

    def logprob_block(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        def entry(tok: str, lp: float) -> dict[str, Any]:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

        return {"content": [{**entry(self.token_text(lp.sampled.token_id), lp.sampled.logprob),
                             "top_logprobs": [entry(self.token_text(a.token_id), a.logprob)
                                              for a in lp.top[:self.top]]} for lp in lps]}
