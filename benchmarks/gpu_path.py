"""The GPU path's figures, in one run on a lent device (issues 26 and 48): the device's bf16
matmul peak and memory bandwidth as measured, then on random weights of a real shape
(--load-format dummy): prefill tokens/s against that peak, single-sequence decode
ms/token against the weight-read bound, decode throughput at several batch sizes with
each step's host time beside its device time, the `tenants` workload offline with prefix
caching on and off, and transformers' own continuous batching (`generate_batch`) on the
same shape and requests.

    python benchmarks/gpu_path.py --out gpu.jsonl                          # on the device
    python benchmarks/gpu_path.py --kv-cache-dtype fp8 --skip-peer --out gpu.jsonl
    python benchmarks/gpu_path.py --device cpu --model FOLDER --quick      # smoke test

One JSON object per line on stdout (and appended to --out): {"what": ..., figures...},
each tagged with the shape, dtype and KV dtype of the run. benchmarks/gpu_run.sh runs it
on a lent GPU (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model.arch import HF_ARCHITECTURES
from hotprefix.model.loader import load_dummy
from hotprefix.model.presets import PRESETS
from hotprefix.model.steps.cuda_graphs import DecodeGraphs


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeat: int = 3) -> float:
    """The best of `repeat` wall times of fn (after one warm-up call), synchronised."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak(device: str, dtype: torch.dtype, n: int) -> dict:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = timed(lambda: a @ b, device, repeat=5)
    return {"what": "matmul_peak", "dtype": str(dtype), "n": n, "tflops": round(2 * n**3 / t / 1e12, 2)}


def bandwidth(device: str, nbytes: int) -> dict:
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), device, repeat=5)
    return {"what": "memory_bandwidth", "bytes": nbytes, "gb_s": round(2 * nbytes / t / 1e9, 1)}  # read + write


class StepClock:
    """Times every engine step of an LLM while installed: its wall time, its shape (how
    many sequences; decode-only or not) and the device time of its forward pass (the CUDA
    graph's replay, or the model's layers) and of its logits, by CUDA events recorded
    around them (their wall time on the CPU). The engine runs a step's parts one after the
    other, so host = wall - device: scheduling, the step's input tensors, the sampler and
    the outputs, while the device waits."""

    def __init__(self, llm: LLM, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.steps: list[dict] = []
        self._busy = False
        runner = llm.engine.runner
        graphs = runner.strategy(DecodeGraphs)
        self._patched = [(llm.engine, "step", self._step), (runner, "execute", self._execute),
                         (runner.model, "forward", self._device), (runner.model, "compute_logits", self._device)]
        if graphs is not None:
            self._patched.append((graphs, "forward", self._device))
        for obj, name, wrap in self._patched:
            setattr(obj, name, wrap(getattr(obj, name)))

    def remove(self) -> None:
        for obj, name, _ in self._patched:
            delattr(obj, name)  # the class's method again

    def _step(self, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            self.steps.append({"wall": 0.0, "rows": 0, "decode": False, "device": []})
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.steps[-1]["wall"] = time.perf_counter() - t0
            return out
        return call

    def _execute(self, fn: Callable) -> Callable:
        def call(sched, *args, **kwargs):
            if self.steps:
                self.steps[-1].update(rows=len(sched.requests),
                                      decode=all(len(r.token_ids) == 1 for r in sched.requests))
            return fn(sched, *args, **kwargs)
        return call

    def _device(self, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            if self._busy or not self.steps:  # (a graph's eager run calls the model inside it)
                return fn(*args, **kwargs)
            self._busy = True
            try:
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = fn(*args, **kwargs)
                    end.record()
                    self.steps[-1]["device"].append((start, end))
                else:
                    t0 = time.perf_counter()
                    out = fn(*args, **kwargs)
                    self.steps[-1]["device"].append(time.perf_counter() - t0)
                return out
            finally:
                self._busy = False
        return call

    def decode_steps(self, rows: int) -> dict:
        """Medians over the decode-only steps of `rows` sequences: wall, device and host
        ms per step, the host's share, and the decode tokens/s that step time gives."""
        if self.cuda:
            torch.cuda.synchronize()
        sel = [s for s in self.steps if s["decode"] and s["rows"] == rows]
        if not sel:
            return {"decode_steps": 0}

        def seconds(span) -> float:  # (start, end) events, or seconds on the CPU
            return span[0].elapsed_time(span[1]) / 1e3 if isinstance(span, tuple) else span

        wall = statistics.median(s["wall"] for s in sel)
        dev = statistics.median(sum(map(seconds, s["device"])) for s in sel)
        return {"decode_steps": len(sel), "step_ms": round(wall * 1e3, 3), "device_ms": round(dev * 1e3, 3),
                "host_ms": round((wall - dev) * 1e3, 3), "host_share": round((wall - dev) / wall, 3),
                "decode_tok_s": round(rows / wall)}


def make_llm(args: argparse.Namespace, prefix_caching: bool = True) -> LLM:
    gc.collect()  # the last LLM's cycles
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    kw = {"num_blocks_override": args.num_blocks} if args.num_blocks else {}
    return LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
               kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
               enable_prefix_caching=prefix_caching, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.batched_tokens, **kw)


def release(llm: LLM, device: str) -> None:
    """Free an LLM's weights, pool and graphs before the next is built (each sizes its
    pool from the device's whole memory)."""
    llm.close()
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (n, length), generator=g).tolist()


def run_generate(llm: LLM, batch: list[list[int]], max_tokens: int, device: str) -> float:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    _sync(device)
    t0 = time.perf_counter()
    llm.generate(batch, sp)
    _sync(device)
    return time.perf_counter() - t0


def prefill_flops(model: torch.nn.Module, arch, n: int, length: int) -> float:
    """The prefill's matmul FLOPs: 2 per weight of the layers per token (the embedding is
    a lookup; the output head runs for the last token only, left out) plus causal
    attention, 2 * length^2 * head_dim per query head and layer."""
    layer_weights = sum(p.numel() for name, p in model.named_parameters()
                        if "embed_tokens" not in name and "lm_head" not in name)
    attention = 2 * length**2 * arch.head_dim * arch.num_heads * arch.num_layers
    return n * (2 * layer_weights * length + attention)


def model_figures(args: argparse.Namespace, peak_tflops: float, gb_s: float) -> list[dict]:
    llm = make_llm(args, prefix_caching=False)
    runner = llm.engine.runner
    params = sum(p.numel() for p in runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    vocab = runner.arch.vocab_size
    out = [{"what": "model", "params": params, "weight_gb": round(weight_bytes / 1e9, 2),
            "backend": runner.backend_kind.value, "cuda_graphs": runner.strategy(DecodeGraphs) is not None,
            "kv_blocks": runner.plan.num_blocks}]
    # prefill: a batch of long prompts, one output token each (the step budget is filled)
    n, length = args.prefill_batch, args.prefill_len
    batch = prompts(n, length, vocab, 1)
    run_generate(llm, batch[:1], 1, args.device)  # warm-up
    t = min(run_generate(llm, batch, 1, args.device) for _ in range(2))
    flops = prefill_flops(runner.model, runner.arch, n, length)
    out.append({"what": "prefill", "prompts": n, "tokens_each": length, "tok_s": round(n * length / t),
                "tflops": round(flops / t / 1e12, 1), "share_of_peak": round(flops / t / 1e12 / peak_tflops, 3)})
    # single-sequence decode: (time of 1 + D tokens - time of 1 token) / D
    d = args.decode_tokens
    one = prompts(1, 128, vocab, 2)
    t1 = min(run_generate(llm, one, 1, args.device) for _ in range(2))
    td = min(run_generate(llm, one, d + 1, args.device) for _ in range(2))
    ms = (td - t1) / d * 1e3
    bound_ms = weight_bytes / (gb_s * 1e9) * 1e3  # issue 48's bound: every weight read once per token
    out.append({"what": "decode_single", "ms_per_token": round(ms, 3), "weight_read_bound_ms": round(bound_ms, 3),
                "share_of_bound": round(bound_ms / ms, 3)})
    clock = StepClock(llm, args.device)
    for b in args.decode_batches:  # decode throughput at batch b, and its steps' host and device time
        clock.steps.clear()
        batch = prompts(b, 128, vocab, 3)
        t = run_generate(llm, batch, d, args.device)
        out.append({"what": "decode_batch", "batch": b, "output_tok_s": round(b * d / t), **clock.decode_steps(b)})
    clock.remove()
    release(llm, args.device)
    return out


def tenants(args: argparse.Namespace) -> list[dict]:
    """The `tenants` workload's texts offline through LLM.generate, prefix caching on and off."""
    from hotprefix.tools.workloads import build  # (no server packages: the lent GPU has none)

    texts = [j.prompt for j in build("tenants", 0, args.scale)[0]]
    return [_tenants_once(args, texts, caching) for caching in (True, False)]


def _tenants_once(args: argparse.Namespace, texts: list[str], caching: bool) -> dict:
    """One LLM's run of the texts. Its own frame holds the LLM, so that it is gone before the
    next is built (a loop's variable kept the first one alive while the second sized its
    pool from the device's memory: out of memory on the H200)."""
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = make_llm(args, prefix_caching=caching)
    llm.generate(texts[:2], sp)  # warm-up
    llm.reset_prefix_cache()
    _sync(args.device)
    t0 = time.perf_counter()
    res = llm.generate(texts, sp)
    _sync(args.device)
    t = time.perf_counter() - t0
    prompt = sum(len(r.prompt_token_ids) for r in res)
    cached = sum(r.num_cached_tokens or 0 for r in res)
    release(llm, args.device)
    return {"what": "tenants_offline", "prefix_caching": caching, "requests": len(texts), "prompt_tokens": prompt,
            "wall_s": round(t, 2), "output_tok_s": round(32 * len(texts) / t), "hit_rate": round(cached / prompt, 3)}


def transformers_peer(args: argparse.Namespace) -> dict:
    """transformers' continuous batching (paged attention) on the same shape (random
    weights) and the tenants requests' token ids."""
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        if args.model in PRESETS:
            raw = dict(PRESETS[args.model])
            cfg = AutoConfig.for_model(HF_ARCHITECTURES[raw.pop("architectures")[0]], **raw)
        else:
            cfg = AutoConfig.from_pretrained(args.model)
        dtype = getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16")
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="paged|sdpa")
        model.eval()
        from hotprefix.tools.workloads import build

        tok = load_dummy(args.model, args.tokenizer).tokenizer
        jobs, _, _ = build("tenants", 0, args.scale)
        ids = [tok.encode(j.prompt) for j in jobs]
        gen = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=-1, num_blocks=2048, block_size=16,
                               max_batch_tokens=args.batched_tokens)
        model.generate_batch(inputs=ids[:2], generation_config=gen)  # warm-up
        _sync(args.device)
        t0 = time.perf_counter()
        model.generate_batch(inputs=ids, generation_config=gen)
        _sync(args.device)
        t = time.perf_counter() - t0
        return {"what": "transformers_generate_batch", "version": transformers.__version__, "requests": len(ids),
                "wall_s": round(t, 2), "output_tok_s": round(32 * len(ids) / t)}
    except Exception as e:  # the peer's API moves between versions: report, do not stop the run
        return {"what": "transformers_generate_batch", "error": f"{type(e).__name__}: {str(e)[:300]}"}


def run_line(args: argparse.Namespace) -> dict:
    """Where and what: the device, the commit (HOTPREFIX_COMMIT where the tree has no
    .git, as on the lent machine), the date and the libraries' versions."""
    commit = os.environ.get("HOTPREFIX_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    line = {"what": "run", "device": platform.processor() or "cpu", "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__}
    if args.device.startswith("cuda"):
        import triton

        line.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    memory_gb=round(torch.cuda.mem_get_info()[1] / 1e9, 1), triton=triton.__version__)
    return line


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a named shape or a config.json folder")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the model's, else the bundled "
                   "default model's; the lent GPU has neither: benchmarks/gpu_run.sh prepare)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None, help="the KV pool's blocks (default: sized from memory)")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--scale", type=float, default=1.0, help="the tenants workload's scale")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test of the script)")
    p.add_argument("--skip-tenants", action="store_true")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.max_model_len, args.max_num_seqs, args.batched_tokens = 512, 8, 512
        args.prefill_batch, args.prefill_len, args.decode_tokens, args.decode_batches = 2, 64, 8, [1, 4]
        args.scale = 0.05
        if not args.device.startswith("cuda"):  # the CPU's fast path: float32 and the C kernels
            args.dtype, args.num_blocks = "float32", args.num_blocks or 256
    return args


def main() -> None:
    args = parse_args()
    tag = {"shape": args.model, "model_dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}

    def emit(d: dict) -> None:
        line = json.dumps({**d, **tag})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    emit(run_line(args))
    mm_dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    peak = matmul_peak(args.device, mm_dtype, 8192 if not args.quick else 512)
    emit(peak)
    bw = bandwidth(args.device, (4 << 30) if not args.quick else (64 << 20))
    emit(bw)
    for d in model_figures(args, peak["tflops"], bw["gb_s"]):
        emit(d)
    if not args.skip_tenants:
        for d in tenants(args):
            emit(d)
    if not args.skip_peer:
        emit(transformers_peer(args))


if __name__ == "__main__":
    main()
