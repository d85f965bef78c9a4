#!/usr/bin/env python3
"""Write a GGUF model as a float32 Hugging Face folder (config, safetensors, tokenizer).

    gguf_to_hf.py MODEL.gguf OUT_DIR

For peers that cannot read the quantized GGUF (vLLM-CPU): transformers dequantizes it on
load; the folder then holds the same weights every system serves, in float32. Needs
torch, transformers, gguf and accelerate (vllm-cpu.sh's venv has them). OUT_DIR is written
through a temporary sibling and renamed, so a stopped run leaves no half folder behind.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def convert(gguf: str, out: str) -> None:
    """Load `gguf` dequantized to float32 and save it under `out` (replaced if present)."""
    folder, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # saved as plain float32: no trace of the GGUF's quantization in the config
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out")
    args = ap.parse_args()
    convert(args.gguf, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
