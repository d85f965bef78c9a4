"""What a structured output's token mask costs per decode step on the default model.

Batch of 8 decodes of the same length, alternating runs: unconstrained (ignore_eos) and
constrained by a JSON schema of a list of at least 20 people (so no row ends early). Prints
the median decode-step time of each and the overhead; the mask's own parts (computing the
allowed set, applying it, advancing the matcher) are timed inside the runner.

    .venv/bin/python benchmarks/structured_overhead.py [BATCH] [REPS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

from hotprefix import LLM, SamplingParams
from hotprefix.sampling_params import StructuredKind, StructuredOutput

warnings.filterwarnings("ignore")
STEPS = 48
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "email": {"type": "string"}},
          "required": ["name", "age", "city", "email"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 20}},
          "required": ["people"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nList twenty people as JSON.<|im_end|>\n<|im_start|>assistant\n"


def decode_steps(llm: LLM, batch: int, constrained: bool) -> list[float]:
    """Seconds of each step in which all `batch` rows decode."""
    eng = llm.engine
    so = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)) if constrained else None
    for i in range(batch):
        params = SamplingParams(max_tokens=STEPS, temperature=1.0, seed=i, structured=so, ignore_eos=so is None)
        eng.add_request(f"r{i}-{time.monotonic_ns()}", PROMPT, params)
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return times[2:-1]  # the prefill steps out, and the step that finishes them


def main(batch: int = 8, reps: int = 5) -> None:
    llm = LLM(kv_cache_memory=1 << 30)
    decode_steps(llm, batch, True)  # compile the grammar, warm up
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for constrained in (False, True):
            runs[constrained] += decode_steps(llm, batch, constrained)
    base, masked = statistics.median(runs[False]), statistics.median(runs[True])
    print(json.dumps({"batch": batch, "steps_each": len(runs[False]),
                      "decode_step_ms": round(base * 1e3, 2), "constrained_step_ms": round(masked * 1e3, 2),
                      "overhead_pct": round(100 * (masked - base) / base, 1)}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
