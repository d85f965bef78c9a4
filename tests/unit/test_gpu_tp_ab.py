"""benchmarks/gpu_tp_ab.py (issue 47's GPU A/B): the options the parent keeps to itself, and
the whole script on the CPU with a tiny config (two 'checkouts' of this tree, one round):
every child's line, and a summary with each checkout's medians and the ratios to the base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_tp_ab  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
        "tie_word_embeddings": False}


def test_child_args_drop_the_parents_options_in_both_spellings():
    argv = ["--checkout", "a=x", "--checkout=b=y", "--rounds", "3", "--out=f.jsonl", "--child-timeout", "9",
            "--model", "m1", "m2", "--quick", "--reps=4"]
    assert gpu_tp_ab._child_args(argv) == ["--model", "m1", "m2", "--quick", "--reps=4"]


def test_the_script_end_to_end_on_the_cpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "ab.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tp_ab.py"), "--device", "cpu", "--quick",
                        "--model", str(tmp_path), "--checkout", f"base={ROOT}", "--checkout", f"new={ROOT}",
                        "--rounds", "1", "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    runs = [d for d in lines if d["what"] == "tp_ab"]
    assert [d["checkout"] for d in runs] == ["base", "new"]
    for d in runs:
        assert d["shape"] == str(tmp_path) and d["batch"] == 4
        assert d["ttft_s"] > 0 and d["decode_ms"] > 0 and d["batch_tok_s"] > 0
    (summary,) = [d for d in lines if d["what"] == "tp_ab_summary"]
    assert summary["base"] == "base" and set(summary["medians"]) == {"base", "new"}
    assert summary["medians"]["new"]["decode_ms"] == runs[1]["decode_ms"]
    assert set(summary["ratio_to_base"]) == {"new"}
    assert not [d for d in lines if d["what"] == "tp_ab_error"]
