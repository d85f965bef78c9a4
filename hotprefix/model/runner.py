"""The model runner: SchedulerOutput in, sampled tokens out.

Owns the torch side: device, weights, KV tensors, per-request generators.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hotprefix.config import (
    AttentionBackend,
    CacheConfig,
    ConfigError,
    ModelConfig,
    PreemptionMode,
    QuantizedMatmul,
    SchedulerConfig,
)
from hotprefix.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hotprefix.grammar import GrammarCompiler
from hotprefix.model.attention import AttentionMetadata, Cascade, build_decode_batch, build_seq_attn
from hotprefix.model.backends import decode_graphs, resolve_backend, triton_meta
from hotprefix.model.fused_decode import FusedDecode, fusable
from hotprefix.model.kv_cache import KVCache, kv_dtype_name, resolve_kv_dtype
from hotprefix.model.kv_offload import HostArena
from hotprefix.model.llama import LlamaForCausalLM
from hotprefix.model.loader import LoadedModel
from hotprefix.model.qlinear import PackedWeight, cpu_vector_flags, library, packable, resolve_matmul
from hotprefix.model.sampler import Sampler, SampleRow, top_logprobs
from hotprefix.model.structured import GrammarMatchers, StepMasks
from hotprefix.model.weight_cache import regrouped_weights
from hotprefix.sizing import activation_bytes_estimate, gpu_kv_budget, num_blocks_in_budget

log = logging.getLogger(__name__)
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are made at once ([256, V] float32: 50 MB at 49k)

DEFAULT_CPU_KV_BYTES = 1 << 30
CASCADE_MIN_BLOCKS = 2  # shared full blocks before a group of decodes attends to them once
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """"auto": float32 on CPU (bf16 matmul is very slow there); on CUDA the
    checkpoint's half type, bfloat16 for float32 checkpoints."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


@dataclass(frozen=True)
class AttentionPaths:
    """Which attention paths a forward pass may take (all by default; tests turn them
    off to compare the paths on one step). decode_batch: on a float32 CPU, all
    single-query decodes attend in one batch; cascade: within it, groups sharing
    leading blocks attend to them once; fused_decode: in int8 mode, a step of decodes
    only runs every layer in one C call (model/fused_decode.py)."""

    decode_batch: bool = True
    cascade: bool = True
    fused_decode: bool = True


ALL_PATHS = AttentionPaths()


@dataclass(frozen=True)
class KVPlan:
    """What start-up decided about the pool."""

    num_blocks: int
    block_size: int
    dtype_name: str
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: the released
    weights were allocated in many medium chunks). A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def plan_kv_pool(loaded: LoadedModel, cache: CacheConfig, sched: SchedulerConfig, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype, weight_bytes: int) -> KVPlan:
    """Size the pool from --kv-cache-memory (CPU) or --gpu-memory-utilization (CUDA).
    Raises ConfigError when not even one block fits."""
    arch = loaded.arch
    name = kv_dtype_name(kv_dtype)
    bpb = arch.kv_shape.bytes_per_block(name, cache.block_size)
    if cache.num_blocks_override is not None:
        n = cache.num_blocks_override
    elif device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        act = activation_bytes_estimate(sched.token_budget, arch.hidden_size, arch.intermediate_size,
                                        arch.vocab_size, sched.max_num_seqs, torch.finfo(dtype).bits // 8)
        n = num_blocks_in_budget(gpu_kv_budget(total, cache.gpu_memory_utilization, weight_bytes, act),
                                 arch.kv_shape, name, cache.block_size)
    else:
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_CPU_KV_BYTES
        n = num_blocks_in_budget(budget, arch.kv_shape, name, cache.block_size)
    if n < 1:
        raise ConfigError(f"the KV cache budget holds no block of {bpb} bytes; "
                          "raise --kv-cache-memory or --gpu-memory-utilization")
    return KVPlan(n, cache.block_size, name, bpb)


def _build_model(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, packed: dict,
                 int8: bool, seed: int = 0) -> LlamaForCausalLM:
    """The model, its products on `packed` blocks; in int8 mode their regrouped forms come
    from weight_cache (mapped from disk after the first start); random weights made on
    the device for a dummy load. Raises ModelLoadError for weights int8 mode cannot serve
    from blocks (LoadedModel.model_weights)."""
    if loaded.dummy:
        from hotprefix.model.dummy import dummy_weights

        return LlamaForCausalLM.from_weights(loaded.arch, dummy_weights(loaded.arch, dtype, device, seed), dtype,
                                             device)
    weights = loaded.model_weights(blocks_only=int8)
    regroup = None
    if int8:
        tied = loaded.arch.tie_word_embeddings  # the embedding's rows are read as they are, unless logits need it
        names = [n for n in packed if n != "model.embed_tokens.weight" or tied]
        regrouped = regrouped_weights(Path(loaded.source), packed, names, library())

        def regroup(name: str, p: PackedWeight) -> PackedWeight:
            return regrouped[name]
    return LlamaForCausalLM.from_weights(loaded.arch, weights, dtype, device, packed, int8, regroup)


class ModelRunner:
    """Runs one step. `execute` mutates the KV tensors and the per-request
    generators; finished request ids in the SchedulerOutput drop their state.
    eos_token_ids: suppressed before a request's min_tokens."""

    def __init__(self, loaded: LoadedModel, model_cfg: ModelConfig, cache_cfg: CacheConfig,
                 sched_cfg: SchedulerConfig, eos_token_ids: tuple[int, ...] = (),
                 grammars: GrammarCompiler | None = None) -> None:
        self.device = resolve_device(model_cfg.device)
        self.dtype = resolve_dtype(model_cfg.dtype, self.device, loaded.arch.torch_dtype)
        blocks = packable(self.device, self.dtype) and bool(loaded.packed or loaded.deferred)
        packed = loaded.packed if blocks else {}
        self.quantized_matmul = resolve_matmul(model_cfg.quantized_matmul) if blocks else None
        int8 = self.quantized_matmul is QuantizedMatmul.INT8
        self.model = _build_model(loaded, self.device, self.dtype, packed, int8, model_cfg.seed)
        if int8:
            log.info("int8 mode: the blocks serve %.0f MB of float32 weights, never held",
                     self.model.release_served_weights() / 1e6)
            if loaded.gguf is not None:
                loaded.gguf.release()  # the file's pages read while loading; embedding rows come back as read
        # the GGUF rows as loaded, to attach again (benchmarks); int8 mode holds regrouped copies instead
        self.packed = {} if int8 else packed
        if packed:
            log.info("%d weights are read as GGUF blocks (%.0f MB), %s; CPU vector flags: %s", len(packed),
                     sum(p.nbytes for p in packed.values()) / 1e6,
                     "with int8 activations" if int8 else
                     "with float32 activations for small batches", " ".join(cpu_vector_flags()) or "none")
        self.arch = self.model.arch
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv_dtype = resolve_kv_dtype(cache_cfg.kv_cache_dtype, self.dtype)
        self.plan = plan_kv_pool(loaded, cache_cfg, sched_cfg, self.device, self.dtype, kv_dtype, weight_bytes)
        self.block_size = cache_cfg.block_size
        self.backend = resolve_backend(model_cfg.attention_backend, self.device)
        # cpu backend: decode attention straight from a float32 pool, and the KV writes into it
        # (csrc/attention.c, csrc/ops.c)
        cpu_kernels = self.backend is AttentionBackend.CPU and kv_dtype == torch.float32
        self._attention_kernel = library() if cpu_kernels else None
        self.kv_cache = KVCache(self.arch.num_layers, self.plan.num_blocks, self.block_size,
                                self.arch.num_kv_heads, self.arch.head_dim, kv_dtype, self.device,
                                kernel=self._attention_kernel)
        self.max_model_len = model_cfg.context_length(self.arch.max_position_embeddings)
        self.graphs = decode_graphs(self.backend, self.model, self.kv_cache, model_cfg, sched_cfg, self.max_model_len)
        # int8 mode: steps of decodes only run every layer in one call (model/fused_decode.py)
        self.fused = FusedDecode(self.model, self.kv_cache, self._attention_kernel) \
            if self.quantized_matmul is QuantizedMatmul.INT8 and \
            fusable(self.model, self.kv_cache, self._attention_kernel) else None
        self.num_host_blocks = 0
        self.host_kv: list = []
        if sched_cfg.preemption_mode is PreemptionMode.SWAP:
            self.num_host_blocks = cache_cfg.swap_space // self.plan.bytes_per_block
            self.host_kv = self.kv_cache.make_host_copy(self.num_host_blocks)
        # the host tier's arena (core/kv_tiers.py decides what moves; engine/kv_disk.py may sit behind it)
        self.host_tier = HostArena(self.kv_cache, cache_cfg.host_tier_bytes // self.plan.bytes_per_block) \
            if cache_cfg.host_tier_bytes and cache_cfg.enable_prefix_caching else None
        self.sampler = Sampler(model_cfg.seed, self.device)
        self.generators: dict[str, torch.Generator] = {}
        self.matchers = GrammarMatchers(grammars, loaded.arch.vocab_size) if grammars is not None else None
        self.eos_token_ids = eos_token_ids
        self.num_computed_tokens_total = 0  # tokens run through the model, for tests and stats
        self.num_swapped_blocks_total = 0  # blocks copied out to host memory
        self._gathered: dict[tuple[int, ...], dict] = {}  # cascade prefix blocks -> gathered K/V, last step only
        slot_bytes = self.arch.num_layers * 2 * self.arch.num_kv_heads * self.arch.head_dim * self.dtype.itemsize
        self._gather_budget = (256 << 20) // slot_bytes  # prefix tokens whose K/V may be kept between steps

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
        blocks = list(range(-(-(n + 1) // self.block_size)))
        for start, chunk in ((0, ids), (n, [0])):
            self.forward(SchedulerOutput([ScheduledRequest("warmup", chunk, start, blocks, False, SamplingParams(),
                                                           ids, [])]))
        self.num_computed_tokens_total = 0

    # -- batch preparation ------------------------------------------------
    def _prepare(self, sched: SchedulerOutput, paths: AttentionPaths
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seqs = []
        bs = self.block_size
        per_seq = self.backend is not AttentionBackend.TRITON  # (triton reads block tables instead)
        for r in sched.requests:
            n = len(r.token_ids)
            if n == 0:  # the scheduler never does this; native kernels crash on it
                raise ValueError(f"request {r.request_id}: a scheduled chunk must hold at least one token")
            q_start = len(ids)
            ids.extend(r.token_ids)
            rng = range(r.start_pos, r.start_pos + n)
            pos.extend(rng)
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in rng)
            if per_seq:
                seqs.append(build_seq_attn(q_start, n, r.start_pos + n, r.block_ids, bs,
                                           self.arch.sliding_window, self.device))
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), seqs)
        if not per_seq:
            meta.triton = triton_meta(sched, self.block_size, self.arch.sliding_window, self.device)
        batched = self.backend is AttentionBackend.CPU and self.dtype == torch.float32 and paths.decode_batch
        if batched and paths.cascade:  # cascades are attended within the decode batch
            self._plan_cascades(sched, meta)
        else:
            self._gathered = {}
        if batched:
            kernel = self._attention_kernel
            meta.decode = build_decode_batch(meta.seqs, 1 if kernel else 2, kernel)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta)

    def _plan_cascades(self, sched: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Group decoding sequences by the blocks they share from the start (prefix
        caching makes those the same block ids): a group of two or more that shares
        at least CASCADE_MIN_BLOCKS blocks, all before each member's query, attends
        to them once (see attention.Cascade)."""
        bs = self.block_size
        kept: dict[tuple[int, ...], dict] = {}
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(sched.requests):
            if len(r.token_ids) == 1 and self.arch.sliding_window is None and r.block_ids:
                groups.setdefault(r.block_ids[0], []).append(i)
        for members in groups.values():
            if len(members) < 2:
                continue
            reqs = [sched.requests[i] for i in members]
            n = 0
            limit = min(r.start_pos // bs for r in reqs)  # shared blocks must end before every query
            while n < limit and all(r.block_ids[n] == reqs[0].block_ids[n] for r in reqs):
                n += 1
            if n < CASCADE_MIN_BLOCKS:
                continue
            shared = n * bs
            for i in members:  # each member keeps only its own suffix
                meta.seqs[i].kv_slots = meta.seqs[i].kv_slots[shared:]
            key = tuple(reqs[0].block_ids[:n])
            c = Cascade(meta.seqs[members[0]].kv_slots.new_tensor(
                [b * bs + o for b in key for o in range(bs)]), members, self._gathered.get(key, {}))
            if sum(len(k) for k in kept) * bs + shared <= self._gather_budget:
                kept[key] = c.gathered
            meta.cascades.append(c)
        self._gathered = kept  # only groups of this step: their blocks stay referenced and unchanged

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput, paths: AttentionPaths = ALL_PATHS) -> torch.Tensor:
        """Run the batch; return the final hidden states [T, E]."""
        input_ids, positions, meta = self._prepare(sched, paths)
        self.num_computed_tokens_total += input_ids.numel()
        if paths.fused_decode and self.fused is not None and self.fused.serves(meta, input_ids.numel()):
            return self.fused.forward(input_ids, positions, meta)
        if self.graphs is not None and self.graphs.serves(meta, input_ids.numel()):
            return self.graphs.forward(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_cache, meta)

    @torch.inference_mode()
    def all_logits(self, sched: SchedulerOutput, paths: AttentionPaths = ALL_PATHS) -> torch.Tensor:
        """Logits of every token in the batch, [T, V] (tests compare them with a reference)."""
        return self.model.compute_logits(self.forward(sched, paths))

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        if r.sampling_params.seed is None or r.sampling_params.greedy:
            return None
        g = self.generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(r.sampling_params.seed % 2**64)  # any int64, negative ones included
            self.generators[r.request_id] = g
        return g

    def forget_step_state(self) -> None:
        """After a failed step: drop what was kept for the next step (gathered
        cascade K/V), which the failed step may have left half made."""
        self._gathered = {}

    def _sample_rows(self, sched: SchedulerOutput, out: ModelRunnerOutput, masks: StepMasks
                     ) -> tuple[list[int], list[str], list[SampleRow]]:
        """(flat index of each sampled row's last token, its request id, its row).
        A request whose row cannot be built (its generator, its grammar's mask) is put
        in out.failed."""
        ends, rids, rows = [], [], []
        end = 0
        for r in sched.requests:
            end += len(r.token_ids)
            if not r.sample or r.sampling_params.max_tokens == 0:  # (0: the prompt only)
                continue
            p = r.sampling_params
            stop_ids = () if p.ignore_eos else self.eos_token_ids
            try:
                if r.request_id in masks.failed:
                    raise RuntimeError(masks.failed[r.request_id])
                row = SampleRow(p, r.prompt_token_ids, r.output_token_ids, tuple(stop_ids) + p.stop_token_ids,
                                self._generator(r), masks.forbidden.get(r.request_id))
            except Exception as e:
                out.failed[r.request_id] = f"sampling could not start: {e}"
                continue
            ends.append(end - 1)
            rids.append(r.request_id)
            rows.append(row)
        return ends, rids, rows

    def _masks(self, sched: SchedulerOutput) -> StepMasks:
        """The structured outputs' masks of this step's sampled rows."""
        constrained = [(r.request_id, r.sampling_params.structured) for r in sched.requests
                       if r.sample and r.sampling_params.structured is not None]
        if not constrained or self.matchers is None:
            return StepMasks()
        return self.matchers.compute(constrained)

    def _copy_blocks(self, sched: SchedulerOutput) -> None:
        """The step's block copies, in SchedulerOutput's order: tier offloads, swaps, tier loads."""
        if self.host_tier is not None:
            self.host_tier.save(sched.tier_offload)
        if sched.swap_out or sched.swap_in:
            self.kv_cache.swap(self.host_kv, sched.swap_out, sched.swap_in)
            self.num_swapped_blocks_total += len(sched.swap_out)
        if self.host_tier is not None:
            self.host_tier.restore(sched.tier_load)

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
        hidden = self.forward(sched)
        self._prompt_logprobs(sched, hidden, out)
        ends, rids, rows = self._sample_rows(sched, out, self._masks(sched))
        if not rows:
            return out
        last = hidden[torch.tensor(ends, device=self.device)]  # [B, E]
        try:
            tokens, lps = self.sampler(self.model.compute_logits(last), rows)  # logits [B, V]
        except Exception:  # one row's parameters broke the batch: sample each row alone to find it
            tokens, lps = self._sample_alone(last, rids, rows, out)
        for rid, tok, lp, row in zip(rids, tokens, lps, rows):
            if tok is None:
                continue
            if row.forbidden is not None and (why := self.matchers.consume(rid, tok)) is not None:
                out.failed[rid] = why
                continue
            out.sampled_token_ids[rid] = tok
            if lp is not None:
                out.logprobs[rid] = lp
        return out

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """The prompt tokens' logprobs of the requests that ask for them: position p's
        logits score prompt token p + 1 (raw logprobs, as vLLM reports them), in slices
        of PROMPT_LOGPROB_ROWS rows. hidden: [T, E]."""
        end = 0
        for r in sched.requests:
            start, end = end, end + len(r.token_ids)
            k = r.sampling_params.prompt_logprobs
            rows = min(len(r.token_ids), len(r.prompt_token_ids) - 1 - r.start_pos)  # rows with a prompt target
            if k is None or rows <= 0:
                continue
            entries = []
            for a in range(0, rows, PROMPT_LOGPROB_ROWS):
                b = min(rows, a + PROMPT_LOGPROB_ROWS)
                lps = torch.log_softmax(self.model.compute_logits(hidden[start + a:start + b]).float(), -1)  # [b-a, V]
                targets = r.prompt_token_ids[r.start_pos + 1 + a:r.start_pos + 1 + b]
                entries += [top_logprobs(lps[i], t, k) for i, t in enumerate(targets)]
            out.prompt_logprobs[r.request_id] = (r.start_pos + 1, entries)

    def _sample_alone(self, last: torch.Tensor, rids: list[str], rows: list[SampleRow], out: ModelRunnerOutput
                      ) -> tuple[list[int | None], list]:
        """Sample row by row (fresh logits each: the batch call changed them in
        place); a row that raises gets no token and its request lands in out.failed."""
        tokens: list[int | None] = []
        lps: list = []
        for i, (rid, row) in enumerate(zip(rids, rows)):
            try:
                (tok,), (lp,) = self.sampler(self.model.compute_logits(last[i:i + 1]), [row])
            except Exception as e:
                log.warning("request %s: sampling failed: %s", rid, e)
                out.failed[rid] = f"sampling failed: {e}"
                tok, lp = None, None
            tokens.append(tok)
            lps.append(lp)
        return tokens, lps
