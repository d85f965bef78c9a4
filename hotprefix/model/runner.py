"""The model runner: SchedulerOutput in, sampled tokens out.

Owns the torch side: device, weights, KV tensors, per-request generators. Which path a
step takes is decided in two places, each once: the attention backend (chosen at start,
model/attention) prepares the step's metadata, and the step strategies (model/steps)
say whether one of them runs the whole step; otherwise the model runs layer by layer.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from hotprefix.config import CacheConfig, ModelConfig, PreemptionMode, QuantizedMatmul, SchedulerConfig
from hotprefix.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hotprefix.errors import PeerLostError
from hotprefix.grammar import GrammarCompiler
from hotprefix.model import steps
from hotprefix.model.attention import ALL_PATHS, AttentionPaths, BackendSpec, create_backend, resolve_backend
from hotprefix.model.attention.base import SeqSpan, StepBatch
from hotprefix.model.build import build_model, kv_groups_of, log_weights, plan_kv_pool, resolve_device, resolve_dtype
from hotprefix.model.drafts import Drafting, verify_drafts
from hotprefix.model.kernels.build import packable, resolve_matmul
from hotprefix.model.kv_cache import KVCache, resolve_kv_dtype
from hotprefix.model.kv_offload import HostArena
from hotprefix.model.loader import LoadedModel
from hotprefix.model.lockstep import RunCopies, RunLogits, RunPersist, RunStep, Stop
from hotprefix.model.parallel import SINGLE, Parallel, shard_arch
from hotprefix.model.sampler import Sampler, SampleRow
from hotprefix.model.scoring import PromptScorer
from hotprefix.model.structured import GrammarMatchers, StepMasks

__all__ = ["ALL_PATHS", "AttentionPaths", "ModelRunner"]
log = logging.getLogger(__name__)


class ModelRunner:
    """Runs one step. `execute` mutates the KV tensors and the per-request generators;
    finished request ids in the SchedulerOutput drop their state. eos_token_ids: suppressed
    before a request's min_tokens. Over several ranks (`parallel`), rank 0's runner sends each step
    to the others (model/lockstep.py), whose runners `follow()`; each holds its heads of the pool."""

    def __init__(self, loaded: LoadedModel, model_cfg: ModelConfig, cache_cfg: CacheConfig,
                 sched_cfg: SchedulerConfig, eos_token_ids: tuple[int, ...] = (),
                 grammars: GrammarCompiler | None = None, parallel: Parallel = SINGLE) -> None:
        self.device = resolve_device(model_cfg.device)
        self.dtype = resolve_dtype(model_cfg.dtype, self.device, loaded.arch.torch_dtype)
        kernels = packable(self.device, self.dtype)  # every product on the C kernels
        blocks = kernels and bool(loaded.packed or loaded.deferred)
        self.quantized_matmul = resolve_matmul(model_cfg.quantized_matmul) if blocks else None
        int8 = self.quantized_matmul is QuantizedMatmul.INT8
        self.parallel = parallel
        self.arch = arch = shard_arch(loaded.arch, parallel.size)  # (a rank's heads and MLP columns)
        kv_dtype = resolve_kv_dtype(cache_cfg.kv_cache_dtype, self.dtype)
        self.block_size = cache_cfg.block_size
        self.backend_kind = resolve_backend(model_cfg.attention_backend, self.device)
        self.kv_groups = kv_groups_of(loaded.arch, cache_cfg)  # None: one block table for every layer
        self.backend = create_backend(self.backend_kind, BackendSpec(
            arch.num_layers, self.device, self.dtype, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.layer_windows, self.block_size, kv_dtype, self.kv_groups))
        self.model, self.served_weight_bytes = build_model(loaded, self.device, self.dtype, kernels, int8,
                                                           self.backend, model_cfg.seed, parallel)
        self.arch = self.model.arch
        log_weights(loaded, blocks, int8, self.served_weight_bytes)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        plan = plan_kv_pool(self.arch, cache_cfg, sched_cfg, self.device, self.dtype, kv_dtype, weight_bytes)
        self.plan = replace(plan, num_blocks=parallel.min_int(plan.num_blocks))  # (the same block ids everywhere)
        self.kv_cache = KVCache(self.arch.num_layers, self.plan.num_blocks, self.block_size,
                                self.arch.num_kv_heads, self.arch.head_dim, kv_dtype, self.device,
                                groups=self.kv_groups)
        self.max_model_len = model_cfg.context_length(self.arch.max_position_embeddings)
        self.steps = self._step_runners(model_cfg, sched_cfg, int8)
        self.scorer = PromptScorer(self.model, parallel, self._logits)
        self._host_copies(cache_cfg, sched_cfg)
        self.sampler = Sampler(model_cfg.seed, self.device)
        self.generators: dict[str, torch.Generator] = {}
        self.matchers = GrammarMatchers(grammars, loaded.arch.vocab_size) if grammars is not None else None
        self.eos_token_ids = eos_token_ids
        self.num_computed_tokens_total = 0  # tokens run through the model, for tests and stats
        self.num_swapped_blocks_total = 0  # blocks copied out to host memory
        self.paths = ALL_PATHS  # the paths execute() lets a step take (benchmarks compare them)

    def _host_copies(self, cache_cfg: CacheConfig, sched_cfg: SchedulerConfig) -> None:
        """Sets num_host_blocks/host_kv (swap) and host_tier (the host tier's arena: core/kv_tiers.py decides
        what moves; engine/kv_disk.py may sit behind it). In a grouped pool both hold pages (every group's
        blocks: model/kv_cache.py)."""
        swap = sched_cfg.preemption_mode is PreemptionMode.SWAP
        per = self.plan.bytes_per_block
        self.num_host_blocks = cache_cfg.swap_space // per if swap else 0
        self.host_kv: list = self.kv_cache.make_host_copy(self.num_host_blocks) if swap else []
        tier = cache_cfg.host_tier_bytes and cache_cfg.enable_prefix_caching
        self.host_tier = HostArena(self.kv_cache, cache_cfg.host_tier_bytes // per, self.parallel) if tier else None

    def _step_runners(self, model_cfg: ModelConfig, sched_cfg: SchedulerConfig, int8: bool) -> list:
        """The whole-step strategies this runner may take (model/steps): the fused decode
        step (int8 mode, the cpu backend), CUDA graphs of decode steps (triton on CUDA)."""
        from hotprefix.model.steps.cuda_graphs import decode_graphs
        from hotprefix.model.steps.fused_decode import FusedDecode, unfusable

        out: list = []
        if int8:
            why = unfusable(self.model, self.kv_cache, self.backend)
            if why is None:
                out.append(FusedDecode(self.model, self.kv_cache, self.backend))
            else:
                log.info("decode steps run layer by layer: %s", why)
        if self.parallel.size > 1:  # (capturing NCCL's collectives in a graph is not tested)
            log.info("decode steps run eagerly: no CUDA graphs over tensor-parallel ranks")
            return out
        graphs = decode_graphs(self.backend_kind, self.model, self.kv_cache, model_cfg, sched_cfg, self.max_model_len,
                               self.kv_groups)
        return out + ([graphs] if graphs is not None else [])

    @torch.inference_mode()
    def warmup(self, num_tokens: int = 4) -> None:
        """One small prefill and one decode through block 0 (free at start; what it
        writes is overwritten before anyone reads it), so the first request does not
        pay the kernels' one-time set-up."""
        from hotprefix.sampling_params import SamplingParams

        n = min(num_tokens, self.block_size * self.plan.num_blocks - 1)
        if n < 1:
            return
        ids = [0] * n
        per = -(-(n + 1) // self.block_size)
        groups = len(self.kv_groups.windows) if self.kv_groups is not None else 0
        if per * max(1, groups) > self.plan.num_blocks:
            return
        tables = tuple(list(range(g * per, (g + 1) * per)) for g in range(groups))  # a grouped pool: each its own
        for start, chunk in ((0, ids), (n, [0])):
            self.forward(SchedulerOutput([ScheduledRequest("warmup", chunk, start, list(range(per)), False,
                                                           SamplingParams(), ids, [], group_block_ids=tables)]))
        self.num_computed_tokens_total = 0

    def strategy(self, cls: type) -> object | None:
        """The whole-step strategy of class `cls` this runner has (model/steps), or None."""
        return next((s for s in self.steps if isinstance(s, cls)), None)

    # -- the step ------------------------------------------------------------
    def _batch(self, sched: SchedulerOutput) -> StepBatch:
        """The step's tokens, positions, KV slots and sequence spans (a draft's positions one
        span each; in a grouped pool, every group's tables and slots). Raises ValueError
        for an empty chunk (the scheduler never makes one; native kernels crash on it)."""
        ids: list[int] = []
        pos: list[int] = []
        seqs: list[SeqSpan] = []
        num_groups = len(self.kv_groups.windows) if self.kv_groups is not None else 0
        slots: list[list[int]] = [[] for _ in range(max(1, num_groups))]
        bs = self.block_size
        for r in sched.requests:
            n = len(r.token_ids)
            if n == 0:
                raise ValueError(f"request {r.request_id}: a scheduled chunk must hold at least one token")
            tables = r.group_block_ids if num_groups else (r.block_ids,)
            if len(tables) != max(1, num_groups):
                raise ValueError(f"request {r.request_id}: {len(tables)} block tables for {num_groups} KV-cache groups")
            # a draft to verify: its positions as decode rows of one sequence (each sees the KV the others
            # write in the same layer: every layer writes the step's KV before it attends), so a step of
            # decodes and drafts stays a decode step (the fused one); the same logits as one chunk
            rows = [(j, 1) for j in range(n)] if r.draft_token_ids else [(0, n)]
            seqs.extend(SeqSpan(len(ids) + j, m, r.start_pos + j, r.block_ids, tables if num_groups else ())
                        for j, m in rows)
            ids.extend(r.token_ids)
            rng = range(r.start_pos, r.start_pos + n)
            pos.extend(rng)
            for out, table in zip(slots, tables):
                out.extend(table[p // bs] * bs + p % bs for p in rng)
        dev = self.device
        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.long, device=dev)

        group_slots = tuple(map(t, slots)) if num_groups else ()
        return StepBatch(t(ids), t(pos), group_slots[0] if num_groups else t(slots[0]), seqs, bs, group_slots)

    def prepare(self, sched: SchedulerOutput, paths: AttentionPaths = ALL_PATHS) -> tuple[StepBatch, object]:
        """The step as the model takes it, and its attention metadata (the backend's)."""
        batch = self._batch(sched)
        return batch, self.backend.prepare(batch, paths)

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput, paths: AttentionPaths = ALL_PATHS) -> torch.Tensor:
        """Run the batch (on every rank); return the final hidden states [T, E]."""
        self.parallel.send(RunStep(sched, paths))
        return self._forward(sched, paths)

    def _forward(self, sched: SchedulerOutput, paths: AttentionPaths) -> torch.Tensor:
        batch, meta = self.prepare(sched, paths)
        self.num_computed_tokens_total += batch.num_tokens
        runner = steps.choose(self.steps, batch, meta, paths)
        if runner is not None:
            return runner.forward(batch, meta)
        return self.model(batch.input_ids, batch.positions, self.kv_cache, meta)

    @torch.inference_mode()
    def all_logits(self, sched: SchedulerOutput, paths: AttentionPaths = ALL_PATHS) -> torch.Tensor:
        """Logits of every token in the batch, [T, V] (tests compare them with a reference)."""
        return self._logits(self.forward(sched, paths), slice(None))

    def _logits(self, hidden: torch.Tensor, rows: slice | list[int], out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits [n, V] of hidden's `rows`, into `out` where the model's head can write them
        there (over several ranks: each rank computes its vocabulary rows of them, gathered
        on rank 0, which says which rows)."""
        self.parallel.send(RunLogits(rows))
        picked = hidden[rows] if isinstance(rows, slice) else hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(picked, out)

    @torch.inference_mode()
    def follow(self) -> None:
        """A rank other than 0: run what rank 0 sends (model/lockstep.py) until Stop.
        Mutates the pool. Raises PeerLostError when rank 0 is gone."""
        hidden = None
        while not isinstance(msg := self.parallel.receive(), Stop):
            if isinstance(msg, RunLogits):
                self._logits(hidden, msg.rows)
            elif isinstance(msg, RunCopies):
                self._copy_blocks(msg.sched, msg.staged)
            elif isinstance(msg, RunPersist):
                self.copied_out(msg.blocks)
            else:
                hidden = self._forward(msg.sched, msg.paths)

    def close(self) -> None:
        """Rank 0: stop the other ranks' loops (a gone peer is not waited for); leave the group."""
        try:
            self.parallel.send(Stop())
        except PeerLostError:
            pass
        self.parallel.close()

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        if r.sampling_params.seed is None or r.sampling_params.greedy:
            return None
        g = self.generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(r.sampling_params.seed % 2**64)  # any int64, negative ones included
            self.generators[r.request_id] = g
        return g

    def _row(self, r: ScheduledRequest, history: list[int], forbidden: torch.Tensor | None) -> SampleRow:
        """The row that samples r's next token after `history` (its output tokens, and a
        draft's before the position); raises if its generator cannot be made."""
        p = r.sampling_params
        stop_ids = (() if p.ignore_eos else self.eos_token_ids) + p.stop_token_ids
        return SampleRow(p, r.prompt_token_ids, history, tuple(stop_ids), self._generator(r), forbidden)

    def forget_step_state(self) -> None:
        """After a failed step: drop what was kept for the next step (the backend's), perhaps half made."""
        self.backend.forget_step_state()

    def _sample_rows(self, sched: SchedulerOutput, out: ModelRunnerOutput, masks: StepMasks
                     ) -> tuple[list[int], list[str], list[SampleRow]]:
        """(flat index of each sampled row's last token, its request id, its row).
        A request whose row cannot be built (its generator, its grammar's mask) is put
        in out.failed."""
        ends, rids, rows = [], [], []
        end = 0
        for r in sched.requests:
            end += len(r.token_ids)
            if not r.sample or r.sampling_params.max_tokens == 0 or r.draft_token_ids:  # (0: the prompt only;
                continue  # a draft: model/drafts.py)
            try:
                if r.request_id in masks.failed:
                    raise RuntimeError(masks.failed[r.request_id])
                row = self._row(r, r.output_token_ids, masks.first(r.request_id))
            except Exception as e:
                out.failed[r.request_id] = f"sampling could not start: {e}"
                continue
            ends.append(end - 1)
            rids.append(r.request_id)
            rows.append(row)
        return ends, rids, rows

    def _masks(self, sched: SchedulerOutput) -> StepMasks:
        """The structured outputs' masks of this step's sampled rows (a draft's too)."""
        constrained = [(r.request_id, r.sampling_params.structured, r.draft_token_ids) for r in sched.requests
                       if r.sample and r.sampling_params.structured is not None]
        if not constrained or self.matchers is None:
            return StepMasks()
        return self.matchers.compute(constrained)

    def _copy_blocks(self, sched: SchedulerOutput, staged: list[int] | None = None) -> None:
        """The step's block copies, in SchedulerOutput's order: tier offloads, swaps, tier loads
        (on every rank: each copies its heads of the blocks; `staged`: rank 0's, sent)."""
        staged = self.host_tier.staged_among(sched.tier_load) if staged is None and self.host_tier else staged or []
        if sched.tier_offload or sched.swap_out or sched.swap_in or sched.tier_load:
            self.parallel.send(RunCopies(sched, staged))
        if self.host_tier is not None:
            self.host_tier.save(sched.tier_offload)
        if sched.swap_out or sched.swap_in:
            self.kv_cache.swap(self.host_kv, sched.swap_out, sched.swap_in)
            self.num_swapped_blocks_total += len(sched.swap_out)
        if self.host_tier is not None:
            self.host_tier.unstage(staged)
            self.host_tier.restore(sched.tier_load)

    def copied_out(self, blocks: list[tuple[int, bytes]]) -> list[tuple[bytes, memoryview]]:
        """HostArena.copied_out for the disk tier, every rank in step. Raises PeerLostError."""
        self.parallel.send(RunPersist(blocks))
        return self.host_tier.copied_out(blocks)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step. Raises only if the forward pass fails (the whole step's
        fault); a row whose sampling fails lands in the output's `failed`."""
        for rid in sched.finished_request_ids:
            self.generators.pop(rid, None)
            if self.matchers is not None:
                self.matchers.drop(rid)
        out = ModelRunnerOutput()
        self._copy_blocks(sched)
        if not sched.requests:
            return out
        hidden = self.forward(sched, self.paths)
        self.scorer.score(sched, hidden, out)
        masks = self._masks(sched)
        verify_drafts(sched, masks, out, Drafting(self.sampler, self.matchers, lambda rows: self._logits(hidden, rows),
                                                  self._row))
        ends, rids, rows = self._sample_rows(sched, out, masks)
        if not rows:
            return out
        try:
            tokens, lps = self.sampler(self._logits(hidden, ends), rows)  # logits [B, V] of hidden [B, E]
        except PeerLostError:
            raise
        except Exception:  # one row's parameters broke the batch: sample each row alone to find it
            tokens, lps = self._sample_alone(hidden, ends, rids, rows, out)
        for rid, tok, lp, row in zip(rids, tokens, lps, rows):
            if tok is None:
                continue
            if row.forbidden is not None and (why := self.matchers.consume(rid, [tok])) is not None:
                out.failed[rid] = why
                continue
            out.sampled_token_ids[rid] = tok
            if lp is not None:
                out.logprobs[rid] = lp
        return out

    def _sample_alone(self, hidden: torch.Tensor, ends: list[int], rids: list[str], rows: list[SampleRow],
                      out: ModelRunnerOutput) -> tuple[list[int | None], list]:
        """Sample row by row (fresh logits each: the batch call changed them in
        place); a row that raises gets no token and its request lands in out.failed."""
        tokens: list[int | None] = []
        lps: list = []
        for i, (rid, row) in enumerate(zip(rids, rows)):
            try:
                (tok,), (lp,) = self.sampler(self._logits(hidden, [ends[i]]), [row])
            except PeerLostError:
                raise
            except Exception as e:
                log.warning("request %s: sampling failed: %s", rid, e)
                out.failed[rid] = f"sampling failed: {e}"
                tok, lp = None, None
            tokens.append(tok)
            lps.append(lp)
        return tokens, lps
