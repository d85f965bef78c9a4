"""The table of benchmarks/real_shapes.sh's results (docs/bench/real/*.json), as markdown:
per file, hotprefix against llama-server, with the ratios the goals are stated in.

    .venv/bin/python benchmarks/real_shapes_table.py [docs/bench/real]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, name: str) -> dict:
    p = folder / f"{name}.json"
    if not p.exists():
        return {}
    data = json.loads(p.read_text())
    return data[0]["results"][0] if isinstance(data, list) else data


def row(folder: Path, tag: str, server: str) -> dict[str, float | None]:
    ttft, dec, sh = (load(folder, f"{tag}-{server}-{w}") for w in ("ttft", "decode", "shared"))
    rss, start = load(folder, f"{tag}-{server}-rss"), load(folder, f"{tag}-{server}-start")
    return {
        "start_s": start.get("server_start_s"),
        "first_start_s": load(folder, f"{tag}-{server}-first").get("first_start_s"),
        "idle_rss_gb": rss["idle_rss_bytes"] / 1e9 if rss.get("idle_rss_bytes") else None,
        "peak_rss_gb": rss["peak_rss_bytes"] / 1e9 if rss.get("peak_rss_bytes") else None,
        "cold_ttft_s": (ttft.get("ttft_s") or {}).get("first"),
        "warm_ttft_s": (ttft.get("ttft_s") or {}).get("warm_median"),
        "decode_tok_s": dec.get("stream_tokens_per_s_median"),
        "shared8_tok_s": sh.get("output_tokens_per_s"),
        "failed": sum(x.get("failed", 0) for x in (ttft, dec, sh)),
        **{f"{w}_cpu_s": load(folder, f"{tag}-{server}-{w}-cpu").get("server_cpu_s")
           for w in ("ttft", "decode", "shared")},
    }


LINES = [("start to /health (first start)", "start_s", "{:.1f} s", "first_start_s"),
         ("idle RSS / peak RSS", "idle_rss_gb", "{:.2f} GB", "peak_rss_gb"),
         ("cold TTFT, 1,030 tokens", "cold_ttft_s", "{:.2f} s", None),
         ("warm TTFT (1,000 shared)", "warm_ttft_s", "{:.3f} s", None),
         ("single-stream decode", "decode_tok_s", "{:.2f} tok/s", None),
         ("8 concurrent on a warm prefix", "shared8_tok_s", "{:.2f} tok/s", None),
         ("server CPU seconds: ttft workload", "ttft_cpu_s", "{:.1f} s", None),
         ("server CPU seconds: decode workload", "decode_cpu_s", "{:.1f} s", None),
         ("server CPU seconds: 8 concurrent", "shared_cpu_s", "{:.1f} s", None),
         ("failed requests", "failed", "{}", None)]


def fmt(v, f: str) -> str:
    return "-" if v is None else f.format(v)


def table(folder: Path, tag: str) -> str:
    hp, ls = row(folder, tag, "hotprefix"), row(folder, tag, "llamaserver")
    bw = load(folder, f"{tag}-bandwidth")
    out = [f"**{tag}** ({bw.get('decode_bytes_per_token', 0) / 1e6:.0f} MB read a decode token; "
           f"streaming read {bw.get('read_bytes_per_s', 0) / 1e9:.1f} GB/s)", "",
           "| | hotprefix | llama-server | hotprefix / llama-server |", "|---|---|---|---|"]
    for label, key, f, extra in LINES:
        cells = []
        for r in (hp, ls):
            c = fmt(r[key], f)
            if extra and r[extra] is not None:
                c += f" ({fmt(r[extra], f)})"
            cells.append(c)
        ratio = hp[key] / ls[key] if hp[key] and ls[key] and key != "failed" else None
        out.append(f"| {label} | {cells[0]} | {cells[1]} | {fmt(ratio, '{:.2f}x')} |")
    if bw.get("read_bytes_per_s"):
        used = [r["decode_tok_s"] * bw["decode_bytes_per_token"] / bw["read_bytes_per_s"] if r["decode_tok_s"]
                else None for r in (hp, ls)]
        out.append("| decode: bytes a token x tokens/s / streaming read | "
                   + " | ".join(fmt(u and 100 * u, "{:.0f} %") for u in used) + " | |")
    kl = load(folder, f"{tag}-kl")
    if kl:
        ours, theirs = kl["hotprefix_int8"], kl["llama_server"]
        out.append(f"| KL against float32 mode, top 20 + rest ({kl['tokens']} tokens; full vocabulary for "
                   f"hotprefix: {ours['kl_full_mean']:.4f}) | {ours['kl_topk_mean']:.2e} | "
                   f"{theirs['kl_topk_mean']:.2e} | |")
        out.append(f"| top-1 agreement with float32 mode | {100 * ours['top1_agrees']:.1f} % | "
                   f"{100 * theirs['top1_agrees']:.1f} % | |")
    share = load(folder, f"{tag}-decode-share")
    if share:
        lo, hi = min(r["share"] for r in share["rounds"]), max(r["share"] for r in share["rounds"])
        out.append(f"| the same, in process, decode and reads alternated (median, range) | "
                   f"{100 * share['share_median']:.0f} % ({100 * lo:.0f}-{100 * hi:.0f}) | | |")
        read = share.get("bytes_read_per_token")
        if read:  # a mixture: what its decode steps read, by the experts' counters, against k of X experts
            out.append(f"| bytes read a decode token (experts by their counters) / the active weights' bytes | "
                       f"{read['total'] / 1e6:.0f} MB / {share['decode_bytes_per_token'] / 1e6:.0f} MB = "
                       f"{read['total'] / share['decode_bytes_per_token']:.3f} | | |")
    return "\n".join(out)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/bench/real")
    tags = sorted({p.name.split("-hotprefix-")[0] for p in folder.glob("*-hotprefix-start.json")})
    meta = load(folder, "meta")
    print(f"{meta.get('date')}, commit {meta.get('commit')}, {meta.get('machine')}, "
          f"flags {' '.join(meta.get('cpu_flags', []))}\n")
    print("\n\n".join(table(folder, t) for t in tags))


if __name__ == "__main__":
    main()
