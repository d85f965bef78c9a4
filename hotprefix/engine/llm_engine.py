"""The engine: requests in, RequestOutputs out, one `step()` at a time.

Read in the order of a request's life: add_request (prepare_request: validate,
tokenize, fan out n samples, in engine/prepare.py; then enqueue) -> step (schedule,
run the model, update) -> _process (detokenize, stop strings, outputs) -> finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hotprefix.config import DiskWritePolicy, EngineConfig
from hotprefix.core.cache_events import Medium, Removed, Stored
from hotprefix.core.hashing import UNSALTED, CacheScope
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.kv_tiers import KVTiers
from hotprefix.core.outputs import EngineCoreOutput
from hotprefix.core.request import RequestStatus
from hotprefix.core.scheduler import Scheduler
from hotprefix.engine.counters import PinSummary, TierGauges
from hotprefix.engine.kv_disk import DiskStore, model_identity, weights_fingerprint
from hotprefix.engine.kv_events import KVEventStream
from hotprefix.engine.outputs import RequestOutput  # (their home; imported from here too)
from hotprefix.engine.prepare import Child, PreparedRequest, RequestPreparer, check_token_ids
from hotprefix.engine.ranks import launch_of, load_rank, start_runner
from hotprefix.engine.requests import DEFAULT_OPTIONS, RequestOptions
from hotprefix.errors import InvalidRequestError, PeerLostError
from hotprefix.grammar import compiler_for
from hotprefix.model.build import return_freed_memory
from hotprefix.model.loader import LoadedModel, generation_defaults
from hotprefix.sampling_params import SamplingParams
from hotprefix.tokenizers.prompt_encoder import PromptEncoder

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the scheduler and the model runner. Not thread-safe: one caller drives `step()`."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 warmup: bool = True) -> None:
        config = config or EngineConfig()
        mc = config.model
        t0 = time.monotonic()
        launch = launch_of(mc.tensor_parallel_size)  # -tp N: rank 0 loads its part, then starts the others
        loaded = load_rank(mc, launch.place) if loaded is None else loaded
        self.max_model_len = mc.context_length(loaded.arch.max_position_embeddings)
        self.config = replace(config, scheduler=config.scheduler.resolved(self.max_model_len))
        self.model_name = loaded.name
        self.default_sampling = generation_defaults(loaded.source, mc.generation_config)
        if self.default_sampling:
            log.info("default sampling parameters from the model's generation config: %s "
                     "(--generation-config vllm to ignore it)", self.default_sampling)
        self.tokenizer = loaded.tokenizer
        self.encoder = PromptEncoder(self.tokenizer)
        eos = set(loaded.arch.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.grammars = compiler_for(self.tokenizer, loaded.arch.vocab_size, eos, self.config.structured)
        self.ranks, self.runner = start_runner(self.config, launch, loaded, tuple(sorted(eos)), self.grammars)
        self.arch = self.runner.arch
        plan = self.runner.plan
        cc = self.config.cache
        self.disk = self._disk_tier(loaded)  # engine/kv_disk.py; None without --kv-disk-dir
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, cc.enable_prefix_caching,
                                 cc.prefix_caching_hash_algo, cc.max_pinned_fraction, self._tiers(),
                                 cc.kv_disk_write is DiskWritePolicy.REUSED, plan.windows, cc.kv_window_retain_interval)
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.runner.num_host_blocks,
                                   self.runner.matchers)  # (a constrained request drafts what its grammar allows)
        self.kv_events = self._kv_events()  # --kv-events-config; None when off
        self.publish_kv_events()  # (the first batch: AllBlocksCleared)
        self.preparer = RequestPreparer(self.encoder, self.grammars, self.arch.vocab_size, self.max_model_len,
                                        frozenset(eos), plan, self.config.scheduler.token_budget)
        self.warmed = False
        if warmup:
            self.warmup()
        self._states: dict[str, PreparedRequest] = {}
        self._child_to_parent: dict[str, str] = {}
        name, loaded = loaded.name, None  # int8 mode's released float32 copies are garbage now
        return_freed_memory()  # (unless the caller holds `loaded`)
        self._log_start(name, time.monotonic() - t0)

    def _log_start(self, name: str, seconds: float) -> None:
        """The start-up lines: what was loaded, the pool, and speculation when it is on."""
        plan = self.runner.plan
        log.info("loaded %s (%s, %d layers) on %s/%s in %.1fs; KV pool: %d blocks x %d tokens = %d tokens "
                 "(%s, %.1f MiB)", name, self.arch.family, self.arch.num_layers, self.runner.device,
                 str(self.runner.dtype).removeprefix("torch."), seconds, plan.num_blocks, plan.block_size,
                 plan.num_tokens, plan.dtype_name, plan.num_blocks * plan.bytes_per_block / 2**20)
        if (spec := self.config.scheduler.speculative_config) is not None:
            log.info("speculative decoding: %s drafts of up to %d tokens (n-grams of %d-%d)", spec.method.value,
                     spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _disk_tier(self, loaded: LoadedModel) -> DiskStore | None:
        """The disk tier --kv-disk-dir asks for, in a directory named by what makes the
        model's KV what it is (see engine/kv_disk.py)."""
        arena, cc = self.runner.host_tier, self.config.cache
        if arena is None or not cc.kv_disk_dir:
            return None
        identity = model_identity(weights=weights_fingerprint(loaded.source), name=loaded.name,
                                  arch=repr(self.runner.arch), dtype=str(self.runner.dtype),
                                  kv=str(arena.data.dtype), block_shape=arena.file_shape,
                                  matmul=str(self.runner.quantized_matmul), hash=cc.prefix_caching_hash_algo)
        return DiskStore(cc.kv_disk_dir, identity, cc.kv_disk_size, arena.file_bytes, arena.slot_bytes,
                         cc.kv_disk_insecure)

    def _tiers(self) -> KVTiers | None:
        """The KV tiers below the pool that the cache config asks for."""
        arena, disk = self.runner.host_tier, self.disk
        if arena is None:
            return None
        log.info("KV tiers: host %d blocks (%.0f MiB)%s", arena.num_slots, arena.num_slots * arena.block_bytes / 2**20,
                 f", disk {disk.dir} ({disk.num_blocks} blocks of {disk.max_files})" if disk else "")
        return KVTiers(arena.num_slots, disk)

    def _kv_events(self) -> KVEventStream | None:
        """The KV events publisher --kv-events-config asks for, recording from now on; its
        first batch (AllBlocksCleared) goes out now. Raises ConfigError for an endpoint
        that cannot be opened."""
        cfg = self.config.cache.kv_events
        if not cfg.enabled:
            return None
        self.kv.record_events()
        if self.disk is not None:
            self.disk.record_changes()
        stream = KVEventStream(cfg, self.kv.block_size, keep=2 * self.kv.num_blocks + 4096)
        log.info("KV events on %s%s, topic %r", cfg.endpoint,
                 f" (replay {cfg.replay_endpoint})" if cfg.replay_endpoint else "", cfg.topic)
        return stream

    def publish_kv_events(self) -> None:
        """Publish what entered and left the cache tiers since the last call (a no-op
        without --kv-events-config). Call on the thread that steps the engine."""
        if self.kv_events is None:
            return
        events = self.kv.take_events()
        if self.disk is not None:
            events += [Stored(h, Medium.DISK) if present else Removed(h, Medium.DISK)
                       for h, present in self.disk.take_changes()]
        self.kv_events.publish(events)

    def tier_gauges(self) -> TierGauges | None:
        """What the KV tiers hold now (None without tiers). Engine thread."""
        arena, disk = self.runner.host_tier, self.disk
        if self.kv.tiers is None or arena is None:
            return None
        g = TierGauges(len(self.kv.tiers.host.entries), arena.num_slots, host_block_bytes=arena.block_bytes)
        if disk is None:
            return g
        return replace(g, disk_blocks=disk.num_blocks, disk_capacity=disk.max_files,
                       disk_written_blocks=disk.stats.written_blocks, disk_read_blocks=disk.stats.read_blocks,
                       disk_bad_files=disk.stats.bad_files, disk_file_bytes=disk.file_bytes)

    def close(self) -> None:
        """Stop the other ranks, finish the disk tier's queued writes, stop the grammar compiler's processes."""
        self.ranks.close(self.runner)
        if self.disk is not None:
            self.disk.close()
        if self.kv_events is not None:
            self.publish_kv_events()  # (the disk's last writes)
            self.kv_events.close()
        self.grammars.close()

    # -- admission ----------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        return self.encoder.tokenize(prompt, add_special_tokens, split_special_tokens)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.encoder.decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None) -> str:
        """See PromptEncoder.apply_chat_template."""
        return self.encoder.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                chat_template)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, operator_messages: int = 0) -> list[int]:
        """The token ids of a conversation (and its tools) through the chat template:
        the template's own special tokens, none added, and none from the messages'
        text (see PromptEncoder.encode_chat). Raises InvalidRequestError."""
        return self.encoder.encode_chat(messages, add_generation_prompt, continue_final_message, chat_template,
                                        template_kwargs, tools, operator_messages)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    options: RequestOptions = DEFAULT_OPTIONS) -> list[int]:
        """Validate and queue a request (n children for n samples). Returns the
        prompt token ids. Raises InvalidRequestError / PromptTooLongError; nothing
        is queued then."""
        prepared = self.prepare_request(request_id, prompt, params, options)
        self.enqueue(prepared)
        return prepared.prompt_token_ids

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                        options: RequestOptions = DEFAULT_OPTIONS) -> PreparedRequest:
        """Tokenize and validate without touching the queues or the pool (safe to
        call from another thread than the one stepping the engine: see RequestPreparer).
        Raises InvalidRequestError, never another error, for any input."""
        return self.preparer.prepare(request_id, prompt, params, options)

    def enqueue(self, state: PreparedRequest) -> None:
        """Queue a prepared request. Raises InvalidRequestError for an id in use or
        a pin_prefix the pin limit has no room for; nothing is queued then."""
        rid = state.request_id
        if rid in self._states:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        first = state.children[0].request
        if first.pin_prefix:
            self.check_pin_room(state.prompt_token_ids, first.cache_scope)
        added = []
        try:
            for c in state.children:
                self.scheduler.add_request(c.request)
                added.append(c.request.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self._states[rid] = state
        for c in state.children:
            self._child_to_parent[c.request.request_id] = rid

    # -- prefix cache control -------------------------------------------------
    def warmup(self) -> None:
        """Run the model once so the first request does not pay the kernels' set-up
        (idempotent). Call it on the thread that will run the steps: see
        AsyncEngine, which warms up on its own thread."""
        if not self.warmed:
            t0 = time.monotonic()
            self.runner.warmup()
            self.warmed = True
            log.info("warm-up step in %.2fs", time.monotonic() - t0)

    def prefix_hashes(self, ids: list[int], scope: CacheScope = UNSALTED) -> list:
        """The block hashes a request with this prompt and scope would get (full blocks
        only). Raises InvalidRequestError for a token id no request may carry."""
        check_token_ids(ids, self.arch.vocab_size, "prompt")
        return self.kv.hasher.hashes_of(ids, scope)

    def check_pin_room(self, ids: list[int], scope: CacheScope) -> None:
        """Raise InvalidRequestError unless pinning this prompt's full blocks stays
        within --max-pinned-fraction (reads the pool: call on the engine thread)."""
        hashes = self.prefix_hashes(ids, scope)
        if not hashes:
            raise InvalidRequestError("pin_prefix needs a prompt of at least one full block "
                                      f"({self.kv.block_size} tokens)", "pin_prefix")
        pinned = sum(1 for h in hashes if (b := self.kv.pool.lookup(h)) is not None and b.pin_cnt > 0)
        new = len(hashes) - pinned
        if self.kv.num_pinned_blocks + new > self.kv.max_pinned_blocks:
            raise InvalidRequestError(
                f"pinning this prompt needs {new} more blocks, but only "
                f"{self.kv.max_pinned_blocks - self.kv.num_pinned_blocks} of the {self.kv.max_pinned_blocks} "
                "allowed by --max-pinned-fraction are free", "pin_prefix")

    def pin_summary(self) -> PinSummary:
        """The pins and the cache now (reads the pool: call on the engine thread)."""
        kv = self.kv
        return PinSummary(kv.num_pinned_blocks, kv.max_pinned_blocks, kv.num_blocks, kv.pool.num_cached_blocks,
                          tuple(bytes(b[0].block_hash or b"") for b in kv.pins.values() if b))

    def pin(self, ids: list[int], scope: CacheScope = UNSALTED) -> int:
        """Pin the cached full blocks of a prompt. Returns blocks newly pinned.
        Raises PinError if the prefix is not cached or the pin limit is reached."""
        return self.kv.pin(self.prefix_hashes(ids, scope))

    def unpin(self, ids: list[int], scope: CacheScope = UNSALTED) -> int:
        """Release the pin of a prompt. Returns the blocks no longer pinned (0 if it was not pinned)."""
        return self.kv.unpin(self.prefix_hashes(ids, scope))

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block; returns how many."""
        n = self.kv.reset_prefix_cache()
        self.publish_kv_events()
        return n

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state; its blocks return to the pool. Unknown ids are ignored."""
        st = self._states.pop(request_id, None)
        if st is None:
            return
        ids = [c.request.request_id for c in st.children]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for cid in ids:
            self._child_to_parent.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    # -- one step -----------------------------------------------------------
    def step(self, scheduled: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Schedule, run the model, and return the requests that progressed.
        scheduled(): called once the step's work is chosen, before the model runs
        (the async engine publishes its live stats there).

        Faults stay with their request: a sampling error fails that request, a
        failed forward pass fails the requests of this step (their KV may be half
        written; the cache entries the step made are rolled back), and an error
        while turning one request's tokens into text fails that request. Only an
        error in scheduling itself (a bug) reaches the caller, which then calls
        `fail_all`."""
        sched = self.scheduler.schedule()
        if scheduled is not None:
            scheduled()
        if not sched.requests and self.disk is not None and self.kv.tiers.loading:
            self.disk.wait_for_reads(0.05)  # only disk reads are in flight: do not spin
        now = time.monotonic()
        for sr in sched.requests:
            st = self._states.get(self._child_to_parent.get(sr.request_id, ""))
            if st is not None and st.first_scheduled_time is None:
                st.first_scheduled_time = now
        try:
            result = self.runner.execute(sched)
        except PeerLostError:
            raise  # the engine cannot step again: the engine loop dies, failing everything in flight
        except Exception as e:
            log.exception("the model step failed; failing the %d requests it held", len(sched.requests))
            self.runner.forget_step_state()
            outs = self._process(self.scheduler.fail_step(sched, f"the model step failed: {e}"))
        else:
            if sched.persist and self.disk is not None:  # their KV is computed now: the disk tier keeps it
                self.disk.persist(self.runner.copied_out(sched.persist))
            outs = self._process(self.scheduler.update(sched, result))
        self.publish_kv_events()
        return outs

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """Fail every unfinished request (the engine loop calls this after a bug in
        scheduling); their blocks return to the pool and nothing half-made stays cached."""
        self.runner.forget_step_state()
        outs = self._process(self.scheduler.fail_all(f"internal error: {error}"))
        self.publish_kv_events()
        return outs

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        touched: dict[str, PreparedRequest] = {}
        new_ids: dict[str, list[int]] = {}
        now = time.monotonic()
        for co in core_outputs:
            parent = self._child_to_parent.get(co.request_id)
            st = self._states.get(parent) if parent else None
            if st is None:
                continue
            child = next(c for c in st.children if c.request.request_id == co.request_id)
            try:
                self._append(st, child, co, new_ids.setdefault(co.request_id, []), now)
            except Exception as e:  # detokenizing or stop strings failed: this request alone
                log.exception("request %s: its output could not be processed", co.request_id)
                self.scheduler.finish_requests([co.request_id], RequestStatus.FINISHED_ERROR)
                child.out.finish_reason, child.out.error = "error", f"its output could not be processed: {e}"
            touched[st.request_id] = st
        return [self._output(st, new_ids, now) for st in touched.values()]

    def _append(self, st: PreparedRequest, child: Child, co: EngineCoreOutput, added: list[int], now: float) -> None:
        """Add one step's tokens to a sample: text, stop strings, finish reason."""
        out = child.out
        if co.new_token_ids:
            st.first_token_time = st.first_token_time or now
        if co.prompt_logprobs is not None and st.prompt_logprobs is None:
            st.prompt_logprobs = co.prompt_logprobs
        for i, tok in enumerate(co.new_token_ids):  # several after a verified draft (speculative decoding)
            out.token_ids.append(tok)
            added.append(tok)
            stop = child.detok.append(tok)
            if co.logprobs:
                out.logprobs = (out.logprobs or []) + co.logprobs[i:i + 1]
            if stop is not None and not co.finished:
                self.scheduler.finish_requests([co.request_id], RequestStatus.FINISHED_STOPPED)
                out.finish_reason, out.stop_reason = "stop", stop
                break
        if co.finished and out.finish_reason is None:
            out.finish_reason = co.finished_status.finish_reason
            out.stop_reason = co.stop_reason
            out.error, out.error_own = co.error, co.error_own
        out.text = child.detok.text

    def _output(self, st: PreparedRequest, new_ids: dict[str, list[int]], now: float) -> RequestOutput:
        finished = st.finished
        deltas = [c.detok.delta(c.out.finished) for c in st.children]
        # Copies: consumers on other threads may read (and annotate) them while
        # the engine goes on. Finished outputs copy their lists too.
        outs = [replace(c.out) for c in st.children]
        if finished:
            outs = [replace(o, token_ids=list(o.token_ids),
                            logprobs=None if o.logprobs is None else list(o.logprobs)) for o in outs]
            self._states.pop(st.request_id, None)
            for c in st.children:
                self._child_to_parent.pop(c.request.request_id, None)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, outs, deltas, finished,
                             new_token_ids=[new_ids.get(c.request.request_id, []) for c in st.children],
                             num_cached_tokens=st.children[0].request.num_cached_tokens or 0,
                             arrival_time=st.arrival_time, first_scheduled_time=st.first_scheduled_time,
                             first_token_time=st.first_token_time, finished_time=now if finished else None,
                             prompt_logprobs=st.prompt_logprobs,
                             block_hashes=list(st.children[0].request.block_hashes) if finished else [])

