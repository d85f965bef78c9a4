"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from hotprefix.config import EngineConfig
from hotprefix.engine.llm_engine import LLMEngine, RequestOutput
from hotprefix.engine.requests import CacheScope, RequestOptions
from hotprefix.flags import build, take_keywords
from hotprefix.sampling_params import SamplingParams
from hotprefix.vllm_flags import ForeignFlags

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Generate for a batch of prompts and return when all are done.

    Keyword arguments are the engine's flags (hotprefix/flags.py builds them from the
    declarations in config.py): each field of ModelConfig, CacheConfig, SchedulerConfig
    and StructuredConfig by its name or by its flag's long name (vLLM's: e.g.
    block_size=16, kv_cache_dtype="fp8", num_gpu_blocks_override=64), in the flag's unit
    (swap_space=4 and kv_offloading_size=4 are GiB, as in vLLM; "512MiB" also works;
    kv_cache_memory is bytes or text such as "2GiB"). vLLM's keywords with no effect here
    (trust_remote_code=True, ...) are logged as such, or refused where they would change
    results (ConfigError). An unknown keyword raises TypeError.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is not None:
            if model is not None or kwargs:
                raise TypeError("give either config or model/keyword arguments, not both")
        else:
            kwargs = {**kwargs, **({"model": model} if model is not None else {})}
            values, foreign = take_keywords(kwargs, EngineConfig), take_keywords(kwargs, ForeignFlags)
            if kwargs:
                raise TypeError(f"LLM() got unknown arguments: {', '.join(sorted(kwargs))}")
            for line in build(ForeignFlags, foreign).lines():
                log.info("LLM(): %s", line)
            config = build(EngineConfig, values)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (see
        ModelConfig.generation_config); what generate() uses when given none."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 add_special_tokens: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text or token ids.
        Raises InvalidRequestError before anything runs if any prompt is invalid."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, p, sp in zip(rids, prompts, plist):
                self.engine.add_request(rid, p, sp, RequestOptions(add_special_tokens=add_special_tokens))
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in rids]

    def pin(self, prompt: Prompt, cache_salt: str | None = None, cache_salt_offset: int = 0) -> int:
        """Compute a prompt's KV (if not cached) and pin its full blocks against
        eviction. Returns the blocks newly pinned; raises PinError at the limit."""
        scope = CacheScope(cache_salt, cache_salt_offset)
        ids = prompt if isinstance(prompt, list) else self.engine.tokenize(prompt)
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(rid, ids, SamplingParams(max_tokens=1), RequestOptions(cache_scope=scope))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return self.engine.pin(ids, scope)

    def unpin(self, prompt: Prompt, cache_salt: str | None = None, cache_salt_offset: int = 0) -> int:
        ids = prompt if isinstance(prompt, list) else self.engine.tokenize(prompt)
        return self.engine.unpin(ids, CacheScope(cache_salt, cache_salt_offset))

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Finish the disk KV tier's queued writes and stop its threads (a no-op without one)."""
        self.engine.close()

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or
        several, then generate. The template's own special tokens are kept as is."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt, continue_final_message, chat_template)
                   for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, add_special_tokens=False)
