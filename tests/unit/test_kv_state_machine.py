"""A Hypothesis state machine over the KV cache manager: allocate (with hits),
append, free, abort, preempt, pin, unpin, reset, and steps that fail (their cache
entries rolled back, their requests freed); integrity after every step, and a
model-based check that a shared block always holds exactly the tokens the
sharing request expects (a block whose KV was never written is never a hit).
GroupedKVMachine runs the same rules over a grouped pool (a full group and a window
group, core/kv_groups.py): every group's blocks are checked, and the window group's
table after every change."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hotprefix.core.hashing import CacheScope
from hotprefix.core.kv_cache_manager import KVCacheManager, PinError
from tests.unit.builders import make_request

BS = 2
NUM_BLOCKS = 12
# Prompts over a 3-token alphabet share prefixes often.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class KVMachine(RuleBasedStateMachine):
    GROUPS: tuple[int | None, ...] = (None,)

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, max_pinned_fraction=0.5, group_windows=self.GROUPS, retain_every=4)
        self.running: dict[str, object] = {}
        self.n = 0
        # Ground truth: (salt, tokens) whose KV each block holds, by block id.
        self.contents: dict[int, tuple[int, ...]] = {}
        self.pinned_prefixes: list[list] = []

    def _tables(self, req) -> list[list]:
        """The request's block table in every group (None where a window group released one)."""
        windows = self.kv.windows.tables.get(req.request_id, []) if self.kv.windows is not None else []
        return [self.kv.req_to_blocks.get(req.request_id, [])] + windows

    def _record(self, req) -> None:
        toks = req.all_token_ids
        for blocks in self._tables(req):
            for i, b in enumerate(blocks):
                lo = i * BS
                hi = min(lo + BS, req.num_computed_tokens)
                if hi > lo and b is not None:
                    self.contents[b.block_id] = (req.cache_scope.salt, tuple(toks[lo:hi]))
        self.kv.advance(req)  # then, as the scheduler does after a step, the window's release

    def _check_hits(self, req, num_hits: int) -> None:
        """Every group's blocks that a fresh allocation took from the cache hold the request's tokens."""
        for blocks in self._tables(req):
            for i, b in enumerate(blocks[:num_hits]):
                if b is not None:
                    expect = (req.cache_scope.salt, tuple(req.all_token_ids[i * BS:(i + 1) * BS]))
                    assert self.contents[b.block_id] == expect

    @rule(prompt=prompts, salt=st.sampled_from([None, "x"]))
    def allocate(self, prompt, salt):
        self.n += 1
        req = make_request(f"r{self.n}", 0, prompt=prompt, cache_scope=CacheScope(salt), max_tokens=50)
        hits = self.kv.get_computed_blocks(req)
        for i, b in enumerate(hits):  # a hit must hold exactly this request's tokens
            assert self.contents[b.block_id] == (salt, tuple(prompt[i * BS:(i + 1) * BS]))
        n = req.num_tokens - len(hits) * BS
        if self.kv.allocate_slots(req, n, hits) is None:
            return
        self._check_hits(req, len(hits))
        self.kv.commit()
        req.num_computed_tokens = req.num_tokens
        self.running[req.request_id] = req
        self._record(req)

    @rule(prompts=st.lists(prompts, min_size=1, max_size=3))
    def failed_step(self, prompts):
        """Requests scheduled together (later ones may hit earlier ones' new blocks),
        then the step fails: whatever it wrote into its new blocks is garbage."""
        step, written = [], set()
        for prompt in prompts:
            self.n += 1
            req = make_request(f"r{self.n}", 0, prompt=prompt, max_tokens=50)
            hits = self.kv.get_computed_blocks(req)
            for i, b in enumerate(hits):
                assert self.contents.get(b.block_id) == (None, tuple(prompt[i * BS:(i + 1) * BS])) or \
                    b.block_id in written  # a same-step hit on a block this step is computing
            new = self.kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits)
            if new is not None:
                step.append(req)
                written.update(b.block_id for b in new)
        undone = self.kv.rollback()
        assert {b.block_id for b in undone} <= written
        for req in step:
            self.kv.free(req)
        for block_id in written:
            self.contents.pop(block_id, None)
        for b in self.kv.pool.blocks:  # none of them is findable any more
            assert b.block_id not in written or b.block_hash is None

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        req.output_token_ids.append(token)
        if self.kv.allocate_slots(req, 1) is None:
            req.output_token_ids.pop()
            return
        self.kv.commit()
        req.num_computed_tokens += 1
        self._record(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):  # finish or abort: the same for the manager
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self.kv.free(req)
        req.num_computed_tokens = 0
        hits = self.kv.get_computed_blocks(req)
        for i, b in enumerate(hits):
            assert self.contents[b.block_id] == (req.cache_scope.salt, tuple(req.all_token_ids[i * BS:(i + 1) * BS]))
        if self.kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits) is None:
            del self.running[req.request_id]
            return
        self._check_hits(req, len(hits))
        self.kv.commit()
        req.num_computed_tokens = req.num_tokens
        self._record(req)

    @rule(prompt=prompts)
    def pin(self, prompt):
        hashes = self.kv.hasher.hashes_of(prompt)
        if not hashes:
            return
        try:
            self.kv.pin(hashes)
        except PinError:
            return
        self.pinned_prefixes.append(hashes)

    @precondition(lambda self: self.pinned_prefixes)
    @rule(data=st.data())
    def unpin(self, data):
        hashes = self.pinned_prefixes.pop(data.draw(st.integers(0, len(self.pinned_prefixes) - 1)))
        self.kv.unpin(hashes)

    @rule()
    def reset(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        assert self.kv.num_pinned_blocks <= self.kv.max_pinned_blocks
        for blocks in self.kv.pins.values():  # pinned blocks are never evicted
            assert all(b.block_hash is not None for b in blocks)

    def teardown(self):
        for req in list(self.running.values()):
            self.kv.free(req)
        for hashes in self.pinned_prefixes:
            self.kv.unpin(hashes)
        self.kv.check_integrity()
        assert self.kv.pool.num_free_blocks == NUM_BLOCKS


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase


class GroupedKVMachine(KVMachine):
    """A full group and a window group of 3 tokens (window tails kept every 4 tokens)."""

    GROUPS = (None, 3)


GroupedKVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestGroupedKVMachine = GroupedKVMachine.TestCase
