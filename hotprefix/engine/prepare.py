"""A request tokenized and validated before it reaches the queues: PreparedRequest.

RequestPreparer holds only what never changes after start-up (the tokenizer, the
grammar compiler, the model's and the pool's sizes), so the preprocessing workers call
it while the engine thread steps. It raises InvalidRequestError, never another error,
for any input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hotprefix.core.request import Request
from hotprefix.engine.outputs import CompletionOutput
from hotprefix.engine.requests import RequestOptions
from hotprefix.errors import InvalidRequestError, PromptTooLongError
from hotprefix.grammar import GrammarCompiler
from hotprefix.sampling_params import SamplingParams, TokenLogprobs
from hotprefix.tokenizers.detokenizer import IncrementalDetokenizer
from hotprefix.tokenizers.prompt_encoder import PromptEncoder

if TYPE_CHECKING:
    from hotprefix.model.build import KVPlan


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Raise InvalidRequestError naming `param` unless every id is a token of the vocabulary."""
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is out of range for vocabulary size {vocab_size}", param)


@dataclass
class Child:
    """One of a request's n samples: the scheduler's Request, its text so far, its output."""

    request: Request
    detok: IncrementalDetokenizer
    out: CompletionOutput


@dataclass
class PreparedRequest:
    """A request tokenized and validated (by `RequestPreparer.prepare`, on any thread),
    not yet queued: its n children (one Request each) and its timing. The engine keeps
    and mutates it once `LLMEngine.enqueue` has taken it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Child]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.children)


@dataclass(frozen=True)
class RequestPreparer:
    """Tokenizes and validates requests against what never changes after start-up: the
    model's vocabulary and context, the KV pool's size. Safe from any thread (the encoder
    and the grammar compiler are)."""

    encoder: PromptEncoder
    grammars: GrammarCompiler
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    plan: KVPlan  # the pool
    chunk_tokens: int  # the most tokens a sequence computes in a step (a grouped pool's window groups need them)

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                options: RequestOptions) -> PreparedRequest:
        """The request's n children, tokenized (a text prompt) and checked, its output
        constraint compiled. Raises InvalidRequestError (PromptTooLongError among them)."""
        if isinstance(prompt, str):
            ids = self.encoder.tokenize(prompt, options.add_special_tokens, options.split_special_tokens)
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
        if options.truncate_prompt_tokens is not None:
            ids = self._truncate(ids, options.truncate_prompt_tokens, params)
        if params.structured is not None and params.structured.grammar is None:
            params = replace(params, structured=self.grammars.compile(params.structured))
        self._validate(ids, params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens "
                                      "left in the context after the prompt", "min_tokens")
        children: list[Child] = []
        for i in range(params.n):
            children.append(self._child(request_id, ids, params, options, i, max_tokens,
                                        children[0].request if children else None))
        return PreparedRequest(request_id, text, ids, children, time.monotonic())

    def _child(self, request_id: str, ids: list[int], params: SamplingParams, options: RequestOptions, i: int,
               max_tokens: int, first: Request | None) -> Child:
        """Sample i of n. The first pins the prefix, if asked, and computes the prompt's
        logprobs, if asked; the others follow it (they start from its cached blocks once it
        has computed the prompt). Raises InvalidRequestError."""
        try:
            cp = replace(params.for_child(i) if params.n > 1 else params, max_tokens=max_tokens)
            if first is not None:
                cp = replace(cp, prompt_logprobs=None)  # the request's prompt logprobs are the first sample's
        except ValueError as e:  # SamplingParams' own checks
            raise InvalidRequestError(str(e), str(e).split(" ")[0]) from None
        cid = request_id if params.n == 1 else f"{request_id}#{i}"
        req = Request(cid, ids, cp, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                      priority=options.priority, cache_scope=options.cache_scope,
                      pin_prefix=options.pin_prefix and i == 0, tenant=options.tenant, follows=first)
        return Child(req, IncrementalDetokenizer(self.encoder, ids, cp), CompletionOutput(i))

    def _truncate(self, ids: list[int], k: int, params: SamplingParams) -> list[int]:
        """The last k of a prompt's tokens (vLLM's left truncation). Raises InvalidRequestError."""
        if k == -1:
            k = self.max_model_len - (params.max_tokens or 1)
        if not 1 <= k <= self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}], got {k}",
                                      "truncate_prompt_tokens")
        return ids[-k:]

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        check_token_ids(ids, vocab, "prompt")
        if len(ids) >= self.max_model_len:  # no room left for a single output token
            raise PromptTooLongError(self.max_model_len, len(ids))
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"stop_token_ids: token id {bad} is out of range for vocabulary size {vocab}",
                                      "stop_token_ids")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(self.max_model_len, len(ids), params.max_tokens)
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequestError(f"logprobs must be <= vocabulary size {vocab}", "logprobs")
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise InvalidRequestError(f"logit_bias token id {t} is out of range for vocabulary size {vocab}",
                                          "logit_bias")
        longest = len(ids) + (params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids))
        longest = min(longest, self.max_model_len)
        if (need := self.plan.sequence_blocks(longest, self.chunk_tokens)) > self.plan.num_blocks:
            raise InvalidRequestError(
                f"the request may need {longest} tokens of KV cache ({need} blocks, window groups' included), but "
                f"the pool holds {self.plan.num_tokens} tokens in {self.plan.num_blocks} blocks; lower max_tokens "
                "or enlarge the KV cache")
