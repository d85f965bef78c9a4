"""Find and load a model: a HF folder, a GGUF file, a hub id, or the bundled default.

Every failure is a ModelLoadError with a one-line message naming what was wrong.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from hotprefix.config import cache_root
from hotprefix.model.arch import ModelArch, ModelLoadError, arch_from_hf_config
from hotprefix.model.default_model import default_model_path
from hotprefix.model.gguf_file import GGUFFile
from hotprefix.model.gguf_loader import (
    DeferredRows,
    dequantize_rows,
    load_gguf_weights,
    read_gguf_arch,
    shard_gguf_weights,
)
from hotprefix.model.parallel import ALONE, Place, ShardPlan

log = logging.getLogger(__name__)



@dataclass
class LoadedModel:
    """Shape, weights (HF names; float32 or the checkpoint's dtype; meta for those kept
    only as GGUF blocks, see model_weights), tokenizer, and where from."""

    arch: ModelArch
    weights: dict[str, torch.Tensor]
    tokenizer: Any
    source: str
    name: str
    packed: dict[str, Any] = field(default_factory=dict)  # HF name -> kernels.weights.PackedWeight (GGUF blocks)
    deferred: dict[str, DeferredRows] = field(default_factory=dict)  # blocks the kernels do not multiply
    gguf: GGUFFile | None = None  # the mapped file the blocks are views of
    dummy: bool = False  # --load-format dummy: no weights; the runner makes random ones (model/dummy.py)

    def model_weights(self, blocks_only: bool, widen_deferred: bool = False) -> dict[str, torch.Tensor]:
        """HF name -> tensor for building the model (a new dict; self is unchanged). A
        weight held only as GGUF blocks (a meta tensor) is dequantized to float32 here, or,
        with blocks_only (the C kernels read it as blocks alone), stays meta. Blocks of a
        type the kernels do not multiply (Q2_K, Q3_K) are widened with widen_deferred
        (float32 mode); else, with blocks_only, ModelLoadError: int8 mode never widens a
        block type to float32."""
        if blocks_only and self.deferred and not widen_deferred:
            name, d = next(iter(self.deferred.items()))
            raise ModelLoadError(
                f"{Path(self.source).name}: {len(self.deferred)} tensors ({name} first) are {d.type_name}, which the "
                f"int8 kernels do not multiply (they read Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); "
                f"--quantized-matmul float32 widens them to float32 ({self.deferred_float_bytes() / 1e9:.1f} GB)")
        out = {}
        for n, w in self.weights.items():
            if w.is_meta and n in self.deferred and (widen_deferred or not blocks_only):
                w = self.deferred[n].dequantize()
            elif w.is_meta and not blocks_only:
                w = dequantize_rows(self.packed[n])
            out[n] = w
        return out

    def deferred_float_bytes(self) -> int:
        return sum(4 * math.prod(d.shape) for d in self.deferred.values())


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local path for the model: the default GGUF, a local folder or file, or a
    hub snapshot (downloaded with huggingface_hub). Raises ModelLoadError."""
    if model is None:
        return default_model_path()
    p = Path(model).expanduser()
    if p.exists():
        return p
    looks_like_path = model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") != 1
    if looks_like_path:
        raise ModelLoadError(f"model path does not exist: {model}")
    return download_from_hub(model, revision, download_dir)


def download_from_hub(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Download config, safetensors and tokenizer files of a hub repo; return the folder.
    Raises ModelLoadError when the hub cannot be reached or the repo does not exist."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                   allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    except Exception as e:  # huggingface_hub raises many error types (network, 404, auth)
        raise ModelLoadError(f"cannot download {repo_id!r} from the hub: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return Path(folder)


def load_model(model: str | None, revision: str | None = None, tokenizer: str | None = None,
               download_dir: str | None = None, place: Place = ALONE) -> LoadedModel:
    """Load shape, weights and tokenizer (a hub model downloaded into download_dir, or
    huggingface_hub's cache); of `place`'s rank, only its part of each weight (ShardPlan).
    Raises ModelLoadError, or ConfigError for a model that does not split over place.size."""
    path = resolve_model(model, revision, download_dir)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or give a HF model folder)")
        t0 = time.monotonic()
        arch, reader = read_gguf_arch(path)
        plan = ShardPlan.of(arch, place)
        w = load_gguf_weights(path, arch, reader, keep_blocks=True)
        w = w if plan is None else shard_gguf_weights(w, plan, path)
        t1 = time.monotonic()
        log.info("mapped %s (%.2f GB): %d tensors, %d as blocks, in %.2fs", path.name, path.stat().st_size / 1e9,
                 len(reader.tensors), len(w.packed) + len(w.deferred), t1 - t0)
        tok = load_tokenizer(tokenizer) if tokenizer else gguf_tokenizer(path, reader)
        log.info("tokenizer ready in %.2fs", time.monotonic() - t1)
        return LoadedModel(arch, w.tensors, tok, str(path), path.stem, w.packed, w.deferred, reader)
    if path.is_dir():
        arch = arch_from_hf_config(_read_config(path))
        weights = load_safetensors(path, ShardPlan.of(arch, place))
        tok = load_tokenizer(tokenizer or str(path))
        return LoadedModel(arch, weights, tok, str(path), path.name)
    raise ModelLoadError(f"model path is neither a file nor a folder: {path}")


def load_dummy(model: str | None, tokenizer: str | None = None) -> LoadedModel:
    """--load-format dummy: the shape of a named one (model/presets.py), of a HF folder's
    config.json or of a GGUF file's header, without weights (LoadedModel.dummy). The
    tokenizer: --tokenizer, else the folder's or the GGUF's, else the bundled default
    model's (ids past its vocabulary detokenize to nothing). Raises ModelLoadError."""
    from hotprefix.model.presets import PRESETS

    name = (model or "").lower()
    if name in PRESETS:
        arch, source, tok_from = arch_from_hf_config(PRESETS[name]), name, None
    else:
        path = resolve_model(model)
        if path.is_file():
            arch, _ = read_gguf_arch(path)
            tok_from = path
        else:
            arch = arch_from_hf_config(_read_config(path))
            has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            tok_from = path if has_tok else None
        source, name = str(path), path.stem if path.is_file() else path.name
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    elif tok_from is None:
        log.info("--load-format dummy: %s has no tokenizer; using the default model's", source)
        tok = gguf_tokenizer(default_model_path())
    else:
        tok = gguf_tokenizer(tok_from) if tok_from.is_file() else load_tokenizer(str(tok_from))
    log.info("--load-format dummy: random weights of %s's shape (%d layers, hidden %d, vocabulary %d)", name,
             arch.num_layers, arch.hidden_size, arch.vocab_size)
    return LoadedModel(arch, {}, tok, source, name, dummy=True)


# generation_config.json field -> SamplingParams field (the ones vLLM takes as defaults)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigSource(str, Enum):
    """--generation-config's two modes (any other value is a folder holding a
    generation_config.json): the model folder's file, or none (the API's defaults)."""

    AUTO = "auto"
    VLLM = "vllm"


def generation_defaults(source: str, setting: str = GenerationConfigSource.AUTO) -> dict[str, float | int]:
    """Default sampling parameters (SamplingParams field names) from a
    generation_config.json: AUTO reads the model folder's (GGUF files have none),
    VLLM gives none, anything else is a folder holding one. Raises ModelLoadError
    for a folder without the file or a file that is not valid."""
    if setting == GenerationConfigSource.VLLM:
        return {}
    auto = setting == GenerationConfigSource.AUTO
    folder = Path(source) if auto else Path(setting).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if auto:
            return {}
        raise ModelLoadError(f"--generation-config {setting}: no generation_config.json there")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    out: dict[str, float | int] = {}
    for key, field_name in GENERATION_DEFAULTS.items():
        v = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[field_name] = v
    return out


def _read_config(folder: Path) -> dict[str, Any]:
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg}: invalid JSON ({e})") from None


def load_safetensors(folder: Path, plan: ShardPlan | None = None) -> dict[str, torch.Tensor]:
    """Single-file or sharded (model.safetensors.index.json) weights; with a plan, only the
    rank's part of each (sliced as read: the rest is never copied). Raises ModelLoadError."""

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not (folder / f).is_file():
            raise ModelLoadError(f"{folder}: shard {f} named in the index is missing")
        try:
            out.update(_read_safetensors(folder / f, plan))
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise ModelLoadError(f"{folder / f}: cannot read safetensors ({e})") from None
    return out


def _read_safetensors(path: Path, plan: ShardPlan | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if plan is None:
        return load_file(str(path))
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
            sl = f.get_slice(name)
            out[name] = plan.cut(name, tuple(sl.get_shape()), lambda i, sl=sl: sl[:] if i is None else sl[i])
    return out


def load_tokenizer(name_or_path: str) -> Any:
    """A local folder's fast tokenizer read without transformers (tokenizers/fast_tokenizer.py),
    else transformers' AutoTokenizer (a hub id, a slow tokenizer). Raises ModelLoadError."""
    from hotprefix.tokenizers.fast_tokenizer import FastTokenizer

    try:
        fast = FastTokenizer.from_folder(name_or_path) if Path(name_or_path).is_dir() else None
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # transformers raises OSError/ValueError/... for a bad folder
        raise ModelLoadError(f"cannot load a tokenizer from {name_or_path}: {str(e).splitlines()[0]}") from None


# what a converted tokenizer is made of: the tokenizer's records (vocabulary, merges, types,
# special ids, chat template) and the architecture (which picks transformers' class)
TOKENIZER_RECORDS = ("tokenizer.", "general.architecture")


def _tokenizer_cache_dir(path: Path, reader: GGUFFile | None = None) -> Path:
    """Where the converted tokenizer of a GGUF file is kept: named by its tokenizer's
    records, so that every file that stores the same tokenizer (another quantization,
    another size of the family, a copy) shares one conversion. Raises GGUFFormatError."""
    key = (reader or GGUFFile(path)).digest(TOKENIZER_RECORDS)[:16]
    return cache_root() / "gguf-tokenizers" / key


def gguf_tokenizer(path: Path, reader: GGUFFile | None = None) -> Any:
    """The tokenizer and chat template stored in a GGUF file's metadata (`reader`: the
    file's parsed header, when the caller has it).

    Converting it takes seconds, so the result is saved under $HOTPREFIX_CACHE (default
    ~/.cache/hotprefix), named by the tokenizer's records, and reused by every file that
    stores them.
    """
    from hotprefix.tokenizers.fast_tokenizer import FastTokenizer, mark_generic

    cache = _tokenizer_cache_dir(path, reader)
    try:
        fast = FastTokenizer.from_folder(cache)
        if fast is not None:
            return fast
    except ValueError:  # a corrupt cache entry: convert again below
        log.warning("ignoring unreadable tokenizer cache %s", cache)
    from transformers import AutoTokenizer

    log.info("converting %s's tokenizer to a fast tokenizer (once; cached in %s) ...", path.name, cache)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"{path.name}: cannot build a tokenizer from GGUF metadata: "
                             f"{str(e).splitlines()[0]}") from None
    try:
        tok.save_pretrained(str(cache))
        mark_generic(cache)
        return FastTokenizer.from_folder(cache) or tok  # the same class as every later start
    except (OSError, ValueError) as e:
        log.warning("cannot cache the GGUF tokenizer in %s: %s", cache, e)
    return tok
