"""The model's shape, read from a HF config.json or a GGUF file's metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotprefix.errors import ModelLoadError as ModelLoadError  # its home is errors.py; re-exported for model/
from hotprefix.model.families import FAMILIES, GGUF_ARCHITECTURES, HF_ARCHITECTURES, MODEL_TYPES
from hotprefix.sizing import KVShape, ModelShape

__all__ = ["GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "ModelArch", "ModelLoadError", "arch_from_hf_config"]
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArch:
    """Everything about the model's shape that the modules need."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a mixture of experts (num_experts > 0): each MoE layer routes a token to the top
    # experts_per_token of num_experts SwiGLU experts of expert_intermediate_size, their
    # softmax weights renormalised over the chosen ones with norm_topk_prob; dense_layers
    # keep a dense MLP of intermediate_size (Qwen3-MoE's mlp_only_layers, decoder_sparse_step)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def shape(self) -> ModelShape:
        """What sizing needs (`hotprefix size` reads a config.json through this parser too)."""
        moe_layers = sum(self.moe_layer(i) for i in range(self.num_layers))
        return ModelShape(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size,
                          self.intermediate_size, self.vocab_size, self.tie_word_embeddings,
                          self.max_position_embeddings, self.num_experts, self.experts_per_token,
                          self.expert_intermediate_size, moe_layers, self.qk_norm)

    def moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def validate(self) -> None:
        """Raise ModelLoadError for shapes or options the modules do not implement."""
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope scaling type {self.rope_type!r} "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.expert_intermediate_size > 0):
            raise ModelLoadError(f"a mixture of {self.num_experts} experts cannot route each token to "
                                 f"{self.experts_per_token} of them (expert FFN {self.expert_intermediate_size})")
        if self.num_experts < 0 or (not self.num_experts and self.experts_per_token):
            raise ModelLoadError(f"{self.experts_per_token} experts per token of {self.num_experts} experts")


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Build a ModelArch from a parsed config.json. Raises ModelLoadError."""
    archs = cfg.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        family = MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')!r} "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"unsupported hidden_act {act!r} (the Llama family uses silu)")
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        window = cfg.get("sliding_window") if family == "mistral" or cfg.get("use_sliding_window") else None
        eos = cfg.get("eos_token_id")
        arch = ModelArch(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=FAMILIES[family].qk_norm,
            sliding_window=window,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            **_moe_fields(cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None
    arch.validate()
    return arch


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields of a config.json (none for a dense model).
    Raises KeyError for an MoE config without its top-k or expert size."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
