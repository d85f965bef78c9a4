"""--load-format dummy: random weights of a model's shape, made on the device in the
compute dtype (an 8B shape in bfloat16 never passes through host memory in float32)."""

from __future__ import annotations

import torch

from hotprefix.model.arch import ModelArch
from hotprefix.model.families import model_class
from hotprefix.model.layers import TorchOps
from hotprefix.model.parallel import SINGLE, Parallel
from hotprefix.model.weight_set import WeightSet


def weight_shapes(arch: ModelArch, parallel: Parallel = SINGLE) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight the family's model takes (its biases included),
    found by building it on the meta device with a recording WeightSet (a rank's parts,
    arch being the rank's shape, over several ranks)."""
    ws = WeightSet({}, torch.float32, torch.device("meta"), family=arch.family, record=True, parallel=parallel)
    model_class(arch.family)(arch, ws, None, TorchOps())
    return ws.shapes


def dummy_weights(arch: ModelArch, dtype: torch.dtype, device: torch.device, seed: int = 0,
                  parallel: Parallel = SINGLE) -> dict[str, torch.Tensor]:
    """HF-named weights for the family's model, every tensor the architecture has (q/k/v
    biases for qwen2): norms 1, biases 0, matrices uniform in ±1/sqrt(fan_in) (torch's
    Linear init), embeddings standard normal; drawn from a generator on `device` seeded
    with `seed`, so a seed gives the same weights on a device."""
    g = torch.Generator(device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(arch, parallel).items():
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        elif "embed_tokens" in name:
            t.normal_(0.0, 1.0, generator=g)
        else:
            bound = shape[1] ** -0.5
            t.uniform_(-bound, bound, generator=g)
        out[name] = t
    return out
