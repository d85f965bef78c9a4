"""The CUDA-graph bookkeeping of decode steps (model/steps/cuda_graphs.py), without CUDA:
the capture sizes, the size a step pads up to, the padding rows (slot -1, length 0), the
block table's width, the refusals, the capture order and which steps replay, and what
decode_graphs builds for each configuration.

The model is a recorder of the rows it is given (its output says which row each came
from); where the code calls torch.cuda's graph API (capture, replay, synchronize) a
stand-in records the calls. What the kernels do with the padding is proven elsewhere:
tests/model/test_triton_attention.py and test_gpu_path.py (interpreted),
tests/model/test_gpu.py (replayed on CUDA)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from hotprefix.config import AttentionBackend, ModelConfig, SchedulerConfig
from hotprefix.model.attention.base import SeqSpan, StepBatch
from hotprefix.model.attention.triton import TritonStep, triton_meta
from hotprefix.model.kernels.triton_attention import decode_splits
from hotprefix.model.kv_cache import KVCache
from hotprefix.model.runner import ALL_PATHS
from hotprefix.model.steps import choose, cuda_graphs
from hotprefix.model.steps.cuda_graphs import DecodeGraphs, decode_graphs, default_sizes
from hotprefix.sizing import KVGroupLayout

BS = 4  # block size
CPU = torch.device("cpu")
LARGER = "larger than the largest graph captured"


@dataclass
class Seen:
    """One call of the model: its rows' ids, slots, lengths and block tables, and the
    step's metadata."""

    ids: list[int]
    slots: list[int]
    seq_lens: list[int]
    tables: torch.Tensor
    query_start_loc: list[int]
    max_query_len: int
    num_splits: int
    windows: tuple[int | None, ...]


class Recorder:
    """The model: records each call; returns hidden [rows, 2] = (input id, position)."""

    def __init__(self) -> None:
        self.calls: list[Seen] = []

    def __call__(self, input_ids, positions, kv_cache, meta: TritonStep) -> torch.Tensor:
        t = meta.triton
        self.calls.append(Seen(input_ids.tolist(), meta.slot_mapping.tolist(), t.seq_lens.tolist(),
                               t.block_tables.clone(), t.query_start_loc.tolist(), t.max_query_len, t.num_splits,
                               tuple(meta.windows)))
        return torch.stack([input_ids, positions], 1).float()


def graphs(sizes=(1, 2, 4, 8), max_blocks=4, splits=3, windows=(None,), capture=False) -> tuple[DecodeGraphs, Recorder]:
    model = Recorder()
    kv = KVCache(1, 64, BS, 1, 8, torch.float32, CPU)
    return DecodeGraphs(model, kv, sizes, max_blocks, splits, windows, CPU, capture=capture), model


def step(ctx_lens: list[int], q_len: int = 1, window: int | None = None, first_id: int = 100):
    """A step of len(ctx_lens) sequences of q_len new tokens each, sequence i holding
    blocks 10 i, 10 i + 1, ...: (StepBatch, TritonStep) as the runner and the triton
    backend make them."""
    seqs, ids, pos, slots = [], [], [], []
    for i, ctx in enumerate(ctx_lens):
        blocks = [10 * i + j for j in range(-(-ctx // BS))]
        seqs.append(SeqSpan(len(ids), q_len, ctx - q_len, blocks))
        for p in range(ctx - q_len, ctx):
            ids.append(first_id + len(ids))
            pos.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
    batch = StepBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), seqs, BS)
    return batch, TritonStep.of(batch.slot_mapping, triton_meta(batch, CPU), (window,))


def test_default_sizes():
    """vLLM's: 1, 2, 4, then every multiple of 8, and --max-num-seqs itself."""
    assert default_sizes(1) == (1,)
    assert default_sizes(2) == (1, 2)
    assert default_sizes(8) == (1, 2, 4, 8)
    assert default_sizes(9) == (1, 2, 4, 8, 9)
    assert default_sizes(256) == (1, 2, 4, *range(8, 257, 8))


def test_a_step_pads_up_to_the_next_size():
    g, model = graphs(sizes=(8, 1, 4, 2, 4))  # unsorted, repeated: sorted once
    assert g.sizes == (1, 2, 4, 8)
    for b, size in ((1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)):
        batch, meta = step([5 + i for i in range(b)])
        out = g.forward(batch, meta)
        seen = model.calls[-1]
        assert len(seen.ids) == size  # the model ran the padded batch
        assert torch.equal(out, torch.stack([batch.input_ids, batch.positions], 1).float())  # the real rows only
        assert seen.query_start_loc == list(range(size + 1)) and seen.max_query_len == 1


def test_padding_rows_write_no_kv_and_read_none():
    """The rows past the step's are slot -1, length 0, also where a larger step before
    left real rows in the buffers; the real rows are the step's."""
    g, model = graphs()
    g.forward(*step([5, 6, 7, 9]))
    batch, meta = step([13, 2, 8], first_id=200)
    g.forward(batch, meta)
    seen = model.calls[-1]
    assert seen.slots == meta.slot_mapping.tolist() + [-1]
    assert seen.seq_lens == [13, 2, 8, 0]
    assert seen.ids[:3] == [200, 201, 202]
    batch, meta = step([3], first_id=300)  # size 1: no padding
    g.forward(batch, meta)
    assert model.calls[-1].slots == meta.slot_mapping.tolist() and model.calls[-1].seq_lens == [3]


def test_the_graphs_split_count_and_window_not_the_steps():
    """A graph is captured at one split count (the longest context's) and window: the
    step's own (its context's split count) is not what runs."""
    g, model = graphs(max_blocks=80, splits=7)
    batch, meta = step([300, 5])
    assert meta.triton.num_splits == decode_splits(300) == 2
    assert g.refusal(batch, meta, ALL_PATHS) is None
    g.forward(batch, meta)
    assert (model.calls[-1].num_splits, model.calls[-1].windows) == (7, (None,))


def test_block_tables_up_to_the_captured_width():
    """max_blocks columns are captured: a step as wide is served, its table in the
    leading columns; a narrower one overwrites only its columns (the rest are past every
    row's length: never read); a wider one is refused."""
    g, model = graphs(max_blocks=4)
    batch, meta = step([16, 9])  # 4 and 3 blocks: width 4
    assert meta.triton.block_tables.shape[1] == 4 and g.refusal(batch, meta, ALL_PATHS) is None
    g.forward(batch, meta)
    assert torch.equal(model.calls[-1].tables[:2], meta.triton.block_tables)
    narrow, nmeta = step([5, 2])  # width 2
    g.forward(narrow, nmeta)
    tables = model.calls[-1].tables
    assert tables.shape == (2, 4)
    assert torch.equal(tables[:, :2], nmeta.triton.block_tables)
    assert torch.equal(tables[:, 2:], meta.triton.block_tables[:, 2:])
    wide, wmeta = step([17])  # 5 blocks
    assert g.refusal(wide, wmeta, ALL_PATHS) == LARGER


def test_refusals_and_which_steps_the_runner_replays():
    """steps.choose takes the graphs for a decode-only step within the largest size,
    the captured width and window; else the step runs eagerly (layer by layer)."""
    g, _ = graphs(sizes=(1, 2, 4), max_blocks=4)
    cases = {
        "decodes": (step([5, 6, 7]), None),
        "as many as the largest": (step([5] * 4), None),
        "more than the largest": (step([5] * 5), LARGER),
        "a prefill": (step([5, 6], q_len=3), "not a decode-only step"),
        "a chunk and a decode": (step([5], q_len=2), "not a decode-only step"),
        "too long a context": (step([20]), LARGER),
        "another window": (step([5], window=16), "other sliding windows"),
    }
    for name, ((batch, meta), why) in cases.items():
        assert g.refusal(batch, meta, ALL_PATHS) == why, name
        assert choose([g], batch, meta, ALL_PATHS) is (g if why is None else None), name


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays; its pool is a token of it."""

    def __init__(self) -> None:
        self.replays = 0

    def pool(self) -> tuple:
        return ("pool of", id(self))

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's graph API as called by DecodeGraphs: each capture (graph, pool) logged."""
    captures: list[tuple[FakeGraph, object]] = []

    @contextmanager
    def graph(g, pool=None):
        captures.append((g, pool))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return captures


def test_capture_largest_first_into_one_pool_with_padding_only(fake_cuda):
    """Every size is run once (its kernels compiled) and then captured, largest first,
    each into the pool of the one before; the buffers hold padding only, so capturing
    writes no KV and reads none."""
    g, model = graphs(sizes=(1, 2, 4), capture=True)
    assert [len(c.ids) for c in model.calls] == [4, 4, 2, 2, 1, 1]
    assert all(c.slots == [-1] * len(c.ids) and c.seq_lens == [0] * len(c.ids) for c in model.calls)
    graph4, graph2, graph1 = (cap[0] for cap in fake_cuda)
    assert [cap[1] for cap in fake_cuda] == [None, graph4.pool(), graph2.pool()]
    assert g.graphs == {4: graph4, 2: graph2, 1: graph1}
    assert {n: out.shape for n, out in g.outputs.items()} == {4: (4, 2), 2: (2, 2), 1: (1, 2)}


def test_a_served_step_replays_the_graph_of_its_size(fake_cuda):
    """The step's rows are copied into the static buffers, padded, and the graph of the
    next size replays; its captured output's leading rows are the step's hidden states."""
    g, model = graphs(sizes=(1, 2, 4), capture=True)
    ran = len(model.calls)
    batch, meta = step([9, 5, 6])
    out = g.forward(batch, meta)
    assert [g.graphs[n].replays for n in (1, 2, 4)] == [0, 0, 1]
    assert len(model.calls) == ran  # replayed, not run
    assert out.shape == (3, 2) and out.data_ptr() == g.outputs[4].data_ptr()
    assert g.slot_mapping[0, :4].tolist() == meta.slot_mapping.tolist() + [-1]
    assert g.seq_lens[:4].tolist() == [9, 5, 6, 0]
    assert g.input_ids[:3].tolist() == batch.input_ids.tolist()
    g.forward(*step([2]))
    assert [g.graphs[n].replays for n in (1, 2, 4)] == [1, 0, 1]


# -- what decode_graphs builds -----------------------------------------------------------

def fake_model(window: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(arch=SimpleNamespace(layer_windows=(window, window)))


def fake_pool(device: str) -> SimpleNamespace:
    """A KV cache as decode_graphs reads it (its device, its block size, one block table for every layer)."""
    return SimpleNamespace(layers=[SimpleNamespace(k=SimpleNamespace(device=torch.device(device)))], block_size=16,
                           grouped=False)


@pytest.fixture
def built(monkeypatch) -> list[dict]:
    """DecodeGraphs replaced by a recorder of its arguments (capturing needs CUDA)."""
    made: list[dict] = []

    def record(model, kv_cache, sizes, max_blocks, num_splits, windows, device, groups):
        made.append(dict(sizes=sizes, max_blocks=max_blocks, num_splits=num_splits, windows=windows,
                         device=device, groups=groups))
        return made[-1]

    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", record)
    return made


@pytest.mark.parametrize("backend", [AttentionBackend.TORCH, AttentionBackend.CPU])
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_no_graphs_for_another_backend(built, backend, device):
    assert decode_graphs(backend, fake_model(), fake_pool(device), ModelConfig(), SchedulerConfig(), 4096) is None
    assert built == []


def test_no_graphs_on_the_cpu(built, caplog):
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        assert decode_graphs(AttentionBackend.TRITON, fake_model(), fake_pool("cpu"), ModelConfig(device="cpu"),
                             SchedulerConfig(), 4096) is None
    assert built == [] and "runs Triton's interpreter" in caplog.text


def test_no_graphs_with_enforce_eager(built, caplog):
    with caplog.at_level(logging.INFO, logger=cuda_graphs.__name__):
        assert decode_graphs(AttentionBackend.TRITON, fake_model(), fake_pool("cuda:0"),
                             ModelConfig(device="cuda", enforce_eager=True), SchedulerConfig(), 4096) is None
    assert built == [] and "--enforce-eager: decode steps run eagerly" in caplog.text


@pytest.mark.parametrize("sizes,max_num_seqs,max_model_len,window,expect", [
    ((), 20, 4096, None, dict(sizes=(1, 2, 4, 8, 16, 20), max_blocks=256, num_splits=16, windows=(None,))),
    ((1, 3), 64, 1000, 512, dict(sizes=(1, 3), max_blocks=63, num_splits=4, windows=(512,))),
    ((), 256, 100, None, dict(sizes=default_sizes(256), max_blocks=7, num_splits=1, windows=(None,))),
])
def test_graphs_on_cuda(built, sizes, max_num_seqs, max_model_len, window, expect):
    """The sizes (--cuda-graph-sizes, else the defaults up to --max-num-seqs), the block
    table's width and split count for --max-model-len, the model's window, the device."""
    got = decode_graphs(AttentionBackend.TRITON, fake_model(window), fake_pool("cuda:0"),
                        ModelConfig(device="cuda", cuda_graph_sizes=sizes), SchedulerConfig(max_num_seqs=max_num_seqs),
                        max_model_len)
    assert built == [got] and got == dict(expect, device=torch.device("cuda", 0), groups=None)


def test_graphs_over_a_grouped_pool(built):
    """A grouped pool's layout reaches the graphs (a block table and slots per KV-cache
    group: tests/model/test_gpu_path.py runs them)."""
    layout = KVGroupLayout.of((8, 8, None, 8))
    got = decode_graphs(AttentionBackend.TRITON, fake_model(), fake_pool("cuda:0"), ModelConfig(device="cuda"),
                        SchedulerConfig(max_num_seqs=4), 64, layout)
    assert built == [got] and got["groups"] is layout and layout.windows == (None, 8, 8, 8)
