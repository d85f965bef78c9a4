"""--load-format dummy: random weights of a model's shape, made on the device in the
compute dtype (an 8B shape in bfloat16 never passes through host memory in float32)."""

from __future__ import annotations

import torch

from hotprefix.model.arch import ModelArch
from hotprefix.model.llama import LlamaForCausalLM


def dummy_weights(arch: ModelArch, dtype: torch.dtype, device: torch.device, seed: int = 0
                  ) -> dict[str, torch.Tensor]:
    """HF-named weights for LlamaForCausalLM.from_weights, every tensor the architecture
    has (q/k/v biases for qwen2): norms 1, biases 0, matrices uniform in
    ±1/sqrt(fan_in) (torch's Linear init), embeddings standard normal; drawn from a
    generator on `device` seeded with `seed`, so a seed gives the same weights on a device."""
    with torch.device("meta"):
        names = dict(LlamaForCausalLM(arch, bias=arch.family == "qwen2").named_parameters())
    g = torch.Generator(device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in names.items():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        elif "embed_tokens" in name:
            t.normal_(0.0, 1.0, generator=g)
        else:
            bound = p.shape[1] ** -0.5
            t.uniform_(-bound, bound, generator=g)
        out[name] = t
    return out
