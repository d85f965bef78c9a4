"""Tensor parallelism on the CPU (gloo, 2 ranks; docs/parallel.md): `-tp 2` in float32 mode
(tiny Llama, Qwen3 and Gemma 3) gives `-tp 1`'s greedy tokens and its logits within
LOGIT_TOL (the row-parallel all-reduces sum partial products in another order, so the
bits may differ), through chunked prefill,
preemption with swaps, a prefix hit and an abort, with the scheduler's and pool's integrity
checked after every step on rank 0; each rank holds half the weights; a model that does not
split is refused with its numbers."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config import AttentionBackend, ConfigError
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.model.arch import arch_from_hf_config
from hotprefix.model.attention import BackendSpec, create_backend
from hotprefix.model.build import build_model
from hotprefix.model.loader import load_model
from hotprefix.model.parallel import Parallel, Place, shard_arch
from hotprefix.model.steps.fused_decode import FusedDecode
from tests.conftest import build_tiny_model

LOGIT_TOL = 1e-4  # float32 logits of the tiny models (|logit| < 10): tp 2 against tp 1
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 17, 9, 12)]


def run_scenario(llm: LLM) -> dict[str, tuple]:
    """Three requests that do not fit the pool together (preemption by swapping), in chunks
    of 16 tokens; a fourth aborted after two steps; then a fifth sharing the third's prompt
    and first tokens (a prefix hit). Integrity after every step. Request id -> (tokens,
    [(sampled logprob, top-2 logprobs)], cached tokens)."""
    e = llm.engine
    final = {}

    def step(times: int | None = None) -> None:
        n = 0
        while e.has_unfinished_requests() and (times is None or n < times):
            for out in e.step():
                if out.finished:
                    final[out.request_id] = out
            e.scheduler.check_integrity()
            n += 1

    p = prompts(0)
    for i, prompt in enumerate(p[:3]):
        e.add_request(f"r{i}", prompt, GREEDY)
    e.add_request("aborted", p[3], GREEDY)
    step(2)
    e.abort_request("aborted")
    step()
    e.add_request("hit", p[2] + final["r2"].outputs[0].token_ids[:3], GREEDY)
    step()
    assert e.scheduler.num_preemptions > 0
    return {rid: (o.outputs[0].token_ids, [(lp.sampled.logprob, [t.logprob for t in lp.top])
                                          for lp in o.outputs[0].logprobs], o.num_cached_tokens)
            for rid, o in final.items() if rid != "aborted"}


def logits_of(llm: LLM) -> torch.Tensor:
    """Every position's logits of one 14-token prefill into blocks 0..3 (a grouped pool's
    other groups: the next 4 blocks each; after the scenario: what it writes there is never
    read again)."""
    ids = prompts(1)[0][:14]
    groups = llm.engine.runner.kv_groups
    tables = tuple(list(range(4 * g, 4 * g + 4)) for g in range(len(groups.windows))) if groups else ()
    sched = SchedulerOutput([ScheduledRequest("x", ids, 0, [0, 1, 2, 3], True, GREEDY, ids, [],
                                              group_block_ids=tables)])
    return llm.engine.runner.all_logits(sched)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def family_folder(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tp-{request.param}")
    build_tiny_model(d, request.param)
    return d


def compare_ranks(folder, grouped: bool, **options) -> None:
    """The scenario and the logits with -tp 1, then -tp 2 (LLM `options`; `grouped`: the
    pool is Gemma's grouped one): the same greedy tokens and cached tokens, logprobs and
    logits within LOGIT_TOL."""
    results, logits = {}, {}
    for tp in (1, 2):
        llm = LLM(model=str(folder), tensor_parallel_size=tp, block_size=4, max_num_batched_tokens=16, device="cpu",
                  **options)
        try:
            assert llm.engine.runner.kv_cache.layers[0].k.shape[::2] == (2 // tp, llm.engine.arch.head_dim)
            assert llm.engine.runner.kv_cache.grouped is grouped
            results[tp] = run_scenario(llm)
            assert (llm.engine.runner.num_swapped_blocks_total > 0) == (options.get("preemption_mode") == "swap")
            llm.engine.kv.check_integrity()
            logits[tp] = logits_of(llm)
        finally:
            llm.close()
    one, two = results[1], results[2]
    assert sorted(one) == sorted(two) == ["hit", "r0", "r1", "r2"]
    assert one["hit"][2] > 0  # the prefix hit happened (the same scheduling on rank 0)
    for rid in one:
        assert two[rid][0] == one[rid][0]  # greedy tokens identical
        assert two[rid][2] == one[rid][2]
        got = torch.tensor([[s, *top] for s, top in two[rid][1]])
        want = torch.tensor([[s, *top] for s, top in one[rid][1]])
        torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL)
    assert logits[2].shape == logits[1].shape == (14, 320)
    torch.testing.assert_close(logits[2], logits[1], rtol=0, atol=LOGIT_TOL)


def test_two_ranks_give_one_ranks_tokens_and_logits(family_folder):
    # preempting by swap; Gemma on its default grouped pool (pages of one layer, the window groups'
    # blocks beside the full group's: more of them)
    grouped = family_folder.name.startswith("tp-gemma3")
    compare_ranks(family_folder, grouped, num_blocks_override=64 if grouped else 14, preemption_mode="swap",
                  swap_space="1MiB")


def test_two_ranks_on_gemmas_grouped_pool_preempting_by_recompute(tmp_path):
    """Gemma 3's default pool: a group per attention kind, the window layers' tables
    releasing blocks behind the window, preempting by recompute (swap: the test above)."""
    build_tiny_model(tmp_path, "gemma3")
    compare_ranks(tmp_path, True, num_blocks_override=60, preemption_mode="recompute")


def resident_bytes(module: torch.nn.Module) -> int:
    """The bytes of the tensors a built model holds (each storage once)."""
    seen = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_each_rank_holds_half_the_weights(tiny_llama):
    """Each rank loads only its part (safetensors sliced) and builds a model of its heads,
    MLP columns and vocabulary rows: within 5 % of half the whole model's bytes."""
    folder = tiny_llama[0]

    def built(place: Place) -> torch.nn.Module:
        loaded = load_model(str(folder), place=place)
        arch = shard_arch(loaded.arch, place.size)
        backend = create_backend(AttentionBackend.CPU, BackendSpec(
            arch.num_layers, torch.device("cpu"), torch.float32, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.layer_windows, 4, torch.float32))
        model, _ = build_model(loaded, torch.device("cpu"), torch.float32, True, False, backend,
                               parallel=Parallel(place))
        return model

    whole = resident_bytes(built(Place(0, 1)))
    for rank in (0, 1):
        part = resident_bytes(built(Place(rank, 2)))
        assert abs(part - whole / 2) <= 0.05 * whole / 2, (rank, part, whole)


def test_a_model_whose_heads_do_not_split_is_refused_with_its_numbers(tmp_path):
    """SmolLM2-135M's shape (9 query heads, 3 KV heads) over 2 ranks."""
    arch = arch_from_hf_config(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320,
                                    hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                    num_attention_heads=9, num_key_value_heads=3))
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 2: the model's 3 KV heads and 9 query heads "
                                          r"do not split over 2 ranks \(the size must divide both: 1, 3\)$"):
        shard_arch(arch, 2)
    assert shard_arch(arch, 3).num_kv_heads == 1


def fused_calls(runner) -> list[int]:
    """The sizes of the steps the runner's fused decode step takes from now on (appended)."""
    fused, calls = runner.strategy(FusedDecode), []
    forward = fused.forward
    fused.forward = lambda batch, meta: calls.append(batch.num_tokens) or forward(batch, meta)
    return calls


@pytest.fixture(scope="module")
def tiny_q8_0(tmp_path_factory):
    """The tiny Llama as a Q8_0 GGUF file."""
    from transformers import AutoTokenizer

    from tests.gguf_util import write_gguf

    d = tmp_path_factory.mktemp("tp-gguf")
    model = build_tiny_model(d / "src", "llama")
    return write_gguf(d / "tiny-Q8_0.gguf", model, AutoTokenizer.from_pretrained(str(d / "src")), "Q8_0")


def test_a_gguf_file_over_two_ranks_in_int8_mode_gives_one_ranks_tokens(tiny_q8_0):
    """Q8_0 blocks split on whole rows (q/k/v, gate/up, the vocabulary) and on block
    boundaries (o and down over K), served by the C kernels as they are (int8 mode: each
    rank's regrouped parts). Decode steps take the fused step on both sizes (over 2 ranks
    its o's and down's sums all-reduced between the C stages): -tp 1's tokens, and over 2
    ranks the layer-by-layer step's logits bit for bit."""
    from tests.model.test_fused_decode import LAYERED, decode_step

    path = tiny_q8_0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got, fused_steps = {}, {}
    for tp in (1, 2):
        llm = LLM(model=str(path), tensor_parallel_size=tp, quantized_matmul="int8", block_size=4,
                  num_blocks_override=64, max_num_batched_tokens=8, device="cpu")
        try:
            runner = llm.engine.runner
            assert runner.quantized_matmul.value == "int8"
            calls = fused_calls(runner)
            got[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts(2)[:3], params)]
            fused_steps[tp] = len(calls)
            if tp == 2:  # a decode step of two sequences after their prefills (blocks 0..3 and 4..7)
                p = [q[:12] for q in prompts(3)[:2]]
                runner.all_logits(SchedulerOutput([ScheduledRequest(f"p{i}", q[:-1], 0, list(range(4 * i, 4 * i + 4)),
                                                                     False, GREEDY, q, []) for i, q in enumerate(p)]))
                step = decode_step(p, [list(range(4 * i, 4 * i + 4)) for i in range(2)])
                layered = runner.all_logits(step, LAYERED)
                assert runner.all_logits(step).equal(layered)
                assert len(calls) == fused_steps[2] + 2  # (the fused step took the prefills' step of 22 tokens and it)
        finally:
            llm.close()
    assert got[2] == got[1]
    assert fused_steps[1] == fused_steps[2] > 0  # every decode step (and step of <= 64 tokens) fused, both sizes


def reduce_with(stack, reducer) -> None:
    """The stack's hp_stack.reduce made `reducer` (what DecodeStack(..., reducer) sets)."""
    stack.reducer, stack.stack.reduce = reducer, reducer.c


def test_the_fused_steps_reducer_is_called_after_each_row_parallel_product_and_carries_its_error(tiny_q8_0):
    """hp_stack.reduce (kernels/reduce.Reducer) on one rank with a stand-in all-reduce: it
    sees o's and then down's [M, E] products, every layer (the identity changes no bit); an
    error inside it skips the later calls and is raised after the C call."""
    from hotprefix.errors import PeerLostError
    from hotprefix.model.kernels.reduce import Reducer
    from tests.model.test_fused_decode import decode_step, prefill, runner_for

    runner = runner_for(tiny_q8_0)
    p = [q[:12] for q in prompts(4)[:3]]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(3)]
    prefill(runner, p, tables)
    fused = runner.strategy(FusedDecode)
    want = runner.all_logits(decode_step(p, tables))
    sizes = []
    reduce_with(fused.stack, Reducer(lambda t: sizes.append(t.numel())))
    assert runner.all_logits(decode_step(p, tables)).equal(want)
    assert sizes == [3 * runner.arch.hidden_size] * (2 * runner.arch.num_layers)

    def lost(t: torch.Tensor) -> None:
        sizes.append(t.numel())
        raise PeerLostError("tensor parallel: a peer rank is gone (all-reduce: stand-in)")

    sizes.clear()
    reduce_with(fused.stack, Reducer(lost))
    with pytest.raises(PeerLostError, match=r"^tensor parallel: a peer rank is gone \(all-reduce: stand-in\)$"):
        runner.all_logits(decode_step(p, tables))
    assert sizes == [3 * runner.arch.hidden_size]


def test_gguf_blocks_split_on_rows_and_on_block_boundaries_only():
    from hotprefix.model.gguf_loader import dequantize_rows
    from hotprefix.model.kernels.weights import PackedWeight

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4, 2 * 34), dtype=torch.uint8, generator=g)
    raw.view(4, 2, 34)[:, :, :2] = torch.tensor([0, 0x20], dtype=torch.uint8)  # f16 scales of 2^-7: finite
    w = PackedWeight.from_gguf("Q8_0", raw, 4, 64)  # 4 rows of two 32-value blocks
    whole = dequantize_rows(w)
    torch.testing.assert_close(dequantize_rows(w.part(1, 32, 64)), whole[:, 32:], rtol=0, atol=0)
    rows = w.part(0, 2, 4, rows=3)  # the last rank's vocabulary rows, padded with a zero block row
    torch.testing.assert_close(dequantize_rows(rows), torch.cat([whole[2:], torch.zeros(1, 64)]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="Q8_0 blocks of 32 values do not split columns 16..48"):
        w.part(1, 16, 48)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_k_quants_the_kernels_do_not_multiply_split_on_block_boundaries(tmp_path, qtype):
    """Q2_K / Q3_K tensors (kept as their bytes, widened to float32 in float32 mode) split
    like the other K-quants: each rank's part dequantizes to exactly its slice of the whole
    (q/k: whole heads of llama.cpp's permuted rows; o/down: 256-value blocks of K), and
    -tp 2 gives -tp 1's greedy tokens and its logits within LOGIT_TOL."""
    from transformers import AutoTokenizer

    from hotprefix.model.gguf_loader import load_gguf_weights, read_gguf_arch, shard_gguf_weights
    from hotprefix.model.parallel import ShardPlan
    from tests.gguf_util import write_gguf

    model = build_tiny_model(tmp_path / "src", "llama", hidden_size=512, intermediate_size=1024)
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", model, AutoTokenizer.from_pretrained(str(tmp_path / "src")),
                      qtype)
    arch, reader = read_gguf_arch(path)
    whole = load_gguf_weights(path, arch, reader, keep_blocks=True)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.embed_tokens.weight"]
    assert all(whole.deferred[n].type_name == qtype for n in names)
    for rank in (0, 1):
        plan = ShardPlan.of(arch, Place(rank, 2))
        part = shard_gguf_weights(whole, plan, path)
        for n in names:
            dim, start, stop = plan.part(n, whole.deferred[n].shape)
            want = whole.deferred[n].dequantize().narrow(dim, start, stop - start)
            assert torch.equal(part.deferred[n].dequantize(), want), n
            assert tuple(part.tensors[n].shape) == tuple(want.shape)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    got = {}
    for tp in (1, 2):
        llm = LLM(model=str(path), tensor_parallel_size=tp, quantized_matmul="float32", block_size=4,
                  num_blocks_override=32, device="cpu")
        try:
            got[tp] = [(o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs])
                       for o in llm.generate([q[:12] for q in prompts(5)[:2]], params)]
        finally:
            llm.close()
    assert [t for t, _ in got[2]] == [t for t, _ in got[1]]
    torch.testing.assert_close(torch.tensor([lp for _, lp in got[2]]), torch.tensor([lp for _, lp in got[1]]),
                               rtol=0, atol=LOGIT_TOL)


def test_the_disk_tier_over_two_ranks_gives_one_ranks_tokens(tiny_llama, tmp_path):
    """-tp 2 with --kv-disk-dir: rank 0 writes whole blocks (every rank's heads gathered:
    files of -tp 1's size) and a restarted engine reads them back, scattering each rank its
    heads before the blocks enter the pool: the prompt's 7 full blocks come from disk, and
    the tokens and logprobs are -tp 1's."""
    from hotprefix.engine.kv_disk import SUFFIX

    prompt = prompts(6)[0]  # 30 tokens: 7 full blocks of 4 before the last token
    got = {}
    for tp in (1, 2):
        for attempt in ("write", "read"):
            llm = LLM(model=str(tiny_llama[0]), tensor_parallel_size=tp, block_size=4, num_blocks_override=64,
                      device="cpu", kv_disk_dir=str(tmp_path / f"tp{tp}"))
            try:
                (o,) = llm.generate([prompt], GREEDY)
            finally:
                llm.close()
            got[tp, attempt] = (o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs],
                                o.num_cached_tokens, llm.engine.disk.stats.read_blocks)
        assert got[tp, "write"][2:] == (0, 0) and got[tp, "read"][2:] == (28, 7)
    assert got[2, "read"][0] == got[2, "write"][0] == got[1, "write"][0] == got[1, "read"][0]
    for attempt in ("write", "read"):
        torch.testing.assert_close(torch.tensor(got[2, attempt][1]), torch.tensor(got[1, attempt][1]),
                                   rtol=0, atol=LOGIT_TOL)
    sizes = {tp: {f.stat().st_size for f in (tmp_path / f"tp{tp}").glob("*/*" + SUFFIX)} for tp in (1, 2)}
    assert len(sizes[1]) == 1 and sizes[2] == sizes[1]
