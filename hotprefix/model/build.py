"""What start-up decides before the first step: the device and dtype, the model built
complete from the loaded weights (model/families), and the pool's size."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hotprefix.config import CacheConfig, ConfigError, SchedulerConfig
from hotprefix.model.arch import ModelArch
from hotprefix.model.attention.base import AttentionBackend
from hotprefix.model.families import model_class
from hotprefix.model.kernels.build import cpu_vector_flags, library
from hotprefix.model.kv_cache import kv_dtype_name
from hotprefix.model.layers import KernelOps, TorchOps
from hotprefix.model.loader import LoadedModel
from hotprefix.model.parallel import SINGLE, Parallel, ShardPlan, shard_arch
from hotprefix.model.weight_cache import regrouped_weights
from hotprefix.model.weight_set import WeightSet
from hotprefix.sizing import KVGroupLayout, activation_bytes_estimate, blocks_for_tokens, gpu_kv_budget

log = logging.getLogger(__name__)
DEFAULT_CPU_KV_BYTES = 1 << 30
EMBED = "model.embed_tokens.weight"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """--device: "auto" is CUDA where there is one. Raises ConfigError for CUDA without one."""
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


def build_model(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, kernels: bool, int8: bool,
                backend: AttentionBackend, seed: int = 0, parallel: Parallel = SINGLE) -> tuple[torch.nn.Module, int]:
    """The model of loaded.arch's family, built complete, and the float32 bytes of weights
    its blocks serve alone (never held). With `kernels` (the C library, a float32 CPU
    model) every product reads blocks: the GGUF file's (in int8 mode their regrouped
    forms, mapped from weight_cache, written at a file's first start) or F32 rows of the
    float weights; otherwise torch multiplies float weights. Random weights are made on
    the device for a dummy load. Raises ModelLoadError for weights int8 mode cannot serve
    from blocks (LoadedModel.model_weights) or that do not match the architecture.
    Over several ranks (`parallel`), the rank's shape (shard_arch) from the rank's weights
    (the loader read only those)."""
    arch = shard_arch(loaded.arch, parallel.size)
    plan = ShardPlan.of(loaded.arch, parallel.place)
    if loaded.dummy:
        from hotprefix.model.dummy import dummy_weights

        ws = WeightSet(dummy_weights(arch, dtype, device, seed, parallel), dtype, device, family=arch.family,
                       f32=kernels, parallel=parallel, plan=plan)
    else:
        packed = loaded.packed if kernels else {}
        ws = WeightSet(loaded.model_weights(blocks_only=kernels, widen_deferred=not int8), dtype, device,
                       _mode_blocks(loaded, packed, int8, parallel), {EMBED: packed[EMBED]} if EMBED in packed else {},
                       family=arch.family, f32=kernels, parallel=parallel, plan=plan)
    model = model_class(arch.family)(arch, ws, backend, KernelOps() if int8 else TorchOps())
    return model.eval(), ws.served_bytes


def _mode_blocks(loaded: LoadedModel, packed: dict, int8: bool, parallel: Parallel) -> dict:
    """The blocks products read: GGUF rows (float32 mode), or their regrouped forms (int8;
    the embedding's only when it is the tied head: lookups read the rows as stored; a
    rank's parts in a cache file of that rank's)."""
    if not int8:
        return packed
    names = [n for n in packed if n != EMBED or loaded.arch.tie_word_embeddings]
    part = "" if parallel.size == 1 else f"rank {parallel.rank} of {parallel.size}"
    return regrouped_weights(Path(loaded.source), packed, names, library(), part)


@dataclass(frozen=True)
class KVPlan:
    """What start-up decided about the pool: its blocks (a grouped pool's: pages of its
    KV-cache groups, sizing.KVGroupLayout), their size and dtype."""

    num_blocks: int
    block_size: int
    dtype_name: str
    bytes_per_block: int
    groups: KVGroupLayout | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV-cache group's window (KVCacheManager's group_windows): (None,) for one group."""
        return self.groups.windows if self.groups is not None else (None,)

    def sequence_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks one sequence of num_tokens holds at once, computing at most
        chunk_tokens a step (a grouped pool's window groups hold theirs beside the full group's)."""
        window = self.groups.window_blocks(num_tokens, self.block_size, chunk_tokens) if self.groups else 0
        return blocks_for_tokens(num_tokens, self.block_size) + window


def kv_groups_of(arch: ModelArch, cache: CacheConfig) -> KVGroupLayout | None:
    """The KV-cache groups the pool is split into (core/kv_groups.py), or None: one block
    table for every layer (one kind of attention, or --no-kv-cache-groups)."""
    return KVGroupLayout.pooled(arch.layer_windows) if cache.kv_cache_groups else None


def plan_kv_pool(arch: ModelArch, cache: CacheConfig, sched: SchedulerConfig, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype, weight_bytes: int) -> KVPlan:
    """Size the pool of `arch` (a rank's: its KV heads) from --kv-cache-memory (CPU) or
    --gpu-memory-utilization (CUDA), per device. Raises ConfigError when not even one block fits."""
    name = kv_dtype_name(kv_dtype)
    groups = kv_groups_of(arch, cache)  # a grouped pool: blocks of one page (and a null block)
    bpb = groups.page_bytes(arch.kv_shape, name, cache.block_size) if groups else \
        arch.kv_shape.bytes_per_block(name, cache.block_size)
    if cache.num_blocks_override is not None:
        n = cache.num_blocks_override
    elif device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        act = activation_bytes_estimate(sched.token_budget, arch.hidden_size, arch.intermediate_size,
                                        arch.vocab_size, sched.max_num_seqs, torch.finfo(dtype).bits // 8)
        n = max(0, gpu_kv_budget(total, cache.gpu_memory_utilization, weight_bytes, act)) // bpb - bool(groups)
    else:
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_CPU_KV_BYTES
        n = budget // bpb - bool(groups)
    if n < 1:
        raise ConfigError(f"the KV cache budget holds no block of {bpb} bytes; "
                          "raise --kv-cache-memory or --gpu-memory-utilization")
    return KVPlan(n, cache.block_size, name, bpb, groups)


def log_weights(loaded: LoadedModel, blocks: bool, int8: bool, served: int) -> None:
    """Say at start what serves the weights (GGUF blocks: how many, which activations, the CPU's
    vector flags) and hand the file's read pages back in int8 mode."""
    if blocks:
        log.info("the blocks serve %.0f MB of float32 weights, never held", served / 1e6)
        if loaded.gguf is not None and int8:
            loaded.gguf.release()  # the file's pages read while loading; embedding rows come back as read
    if blocks and loaded.packed:
        log.info("%d weights are read as GGUF blocks (%.0f MB), %s; CPU vector flags: %s", len(loaded.packed),
                 sum(p.nbytes for p in loaded.packed.values()) / 1e6,
                 "with int8 activations" if int8 else "with float32 activations",
                 " ".join(cpu_vector_flags()) or "none")


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: the released
    weights were allocated in many medium chunks). A no-op where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
