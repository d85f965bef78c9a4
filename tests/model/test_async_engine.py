"""The async engine: streaming, early errors, admission, aborts, fault isolation,
and 1,000 requests with random aborts."""

from __future__ import annotations

import asyncio
import random

import pytest

from hotprefix import LLM, SamplingParams
from hotprefix.config import AdmissionConfig
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.errors import InvalidRequestError, PromptTooLongError, QueueFullError


def make_engine(folder, **kw) -> AsyncEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks_override", 64)
    max_queued = kw.pop("max_queued", 1024)
    return AsyncEngine(LLM(model=str(folder), **kw).engine, AdmissionConfig(max_queued))


async def idle(engine: AsyncEngine) -> None:
    """Wait until the engine thread has no request left, then check the pool."""
    for _ in range(500):
        if not await engine.call(lambda e: e.has_unfinished_requests()):
            break
        await asyncio.sleep(0.01)
    kv = engine._engine.kv

    def check(e):
        e.scheduler.check_integrity()
        return kv.pool.num_free_blocks

    assert await engine.call(check) == kv.num_blocks


def test_stream_matches_offline_and_deltas_add_up(tiny_llama):
    folder = tiny_llama[0]
    prompt = list(range(20, 37))
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = LLM(model=str(folder), num_blocks_override=64).generate([prompt], sp)[0].outputs[0]

    async def main():
        eng = make_engine(folder)
        eng.start()
        outs = [o async for o in eng.generate("r", prompt, sp)]
        await idle(eng)
        await eng.shutdown()
        return outs

    outs = asyncio.run(main())
    assert [t for o in outs for t in o.new_token_ids[0]] == ref.token_ids
    assert "".join(o.deltas[0] for o in outs) == ref.text == outs[-1].outputs[0].text
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].first_token_time >= outs[-1].first_scheduled_time >= outs[-1].arrival_time


def test_bad_requests_fail_before_anything_is_queued(tiny_llama):
    async def main():
        eng = make_engine(tiny_llama[0], max_model_len=16, max_queued=3)
        eng.start()
        with pytest.raises(PromptTooLongError):
            await eng.submit("long", [list(range(3, 30))], SamplingParams(max_tokens=1))
        with pytest.raises(PromptTooLongError):  # 16 tokens leave no room for one output token
            await eng.submit("full", [list(range(3, 19))], SamplingParams(max_tokens=None))
        with pytest.raises(InvalidRequestError):
            await eng.submit("empty", [[]], SamplingParams())
        with pytest.raises(InvalidRequestError, match="more than the 3 the server queues"):
            await eng.submit("wide", [[5, 6]], SamplingParams(max_tokens=3, n=4))
        assert eng.num_queued == 0 and eng.num_unfinished == 0
        (a,) = await eng.submit("a", [[5, 6]], SamplingParams(max_tokens=3))
        (a2,) = await eng.submit("a", [[5, 6]], SamplingParams(max_tokens=3))  # a client id may repeat
        assert a.request_id != a2.request_id
        assert eng.num_queued == 2
        with pytest.raises(QueueFullError, match="2 sequences waiting"):
            await eng.submit("c", [[5, 8]], SamplingParams(max_tokens=3, n=2))
        assert eng.num_queued == 2  # the refused request reserved nothing
        assert [o async for o in a][-1].finished and [o async for o in a2][-1].finished
        assert eng.num_queued == 0
        (c,) = await eng.submit("c", [[5, 8]], SamplingParams(max_tokens=3, n=2))  # room again
        c.close()
        assert eng.num_queued == 0
        await idle(eng)
        await eng.shutdown()

    asyncio.run(main())


def test_a_request_id_reused_after_an_abort_never_gets_the_old_requests_outputs(tiny_llama):
    """The engine's ids are its own: closing a stream and submitting the same client
    id at once (while the old request's step is still running) cannot cross outputs."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref_new = LLM(model=str(tiny_llama[0]), num_blocks_override=64).generate([[40, 41, 42]], sp)[0].outputs[0]

    async def main():
        eng = make_engine(tiny_llama[0])
        eng.start()
        for _ in range(20):
            (old,) = await eng.submit("same", [[7, 8, 9]], SamplingParams(max_tokens=200, ignore_eos=True))
            await old.queue.get()  # running
            old.close()
            (new,) = await eng.submit("same", [[40, 41, 42]], sp)
            toks = [t async for o in new for t in o.new_token_ids[0]]
            assert toks == ref_new.token_ids
        await idle(eng)
        await eng.shutdown()

    asyncio.run(main())


def test_a_stream_closed_before_it_was_read_frees_its_request(tiny_llama):
    async def main():
        eng = make_engine(tiny_llama[0])
        eng.start()
        streams = await eng.submit("r", [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=50, ignore_eos=True))
        for s in streams:
            s.close()
        await idle(eng)
        assert eng.num_unfinished == 0 and eng.num_queued == 0
        await eng.shutdown()

    asyncio.run(main())


def test_a_sampling_error_fails_its_request_alone(tiny_llama):
    """A row that breaks the sampler (here a stop id the engine's check was bypassed
    for) fails that request with finish_reason "error"; the request stepping beside
    it produces exactly its tokens."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(model=str(tiny_llama[0]), num_blocks_override=64).generate([[20, 21, 22]], sp)[0].outputs[0]

    async def main():
        eng = make_engine(tiny_llama[0])
        eng.start()
        (good,) = await eng.submit("good", [[20, 21, 22]], sp)
        # (however many tokens "bad" made before the poison lands, its next row still has min_tokens
        # to go, so the bad stop id is used at once: no race with the engine thread)
        (bad,) = await eng.submit("bad", [[5, 6]], SamplingParams(max_tokens=250, ignore_eos=True))
        state = await eng.call(lambda e: e._states[bad.request_id])
        poisoned = SamplingParams(max_tokens=250, min_tokens=249, stop_token_ids=(10**6,))
        await eng.call(lambda e: setattr(state.children[0].request, "sampling_params", poisoned))
        bad_outs = [o async for o in bad]
        good_outs = [o async for o in good]
        await idle(eng)
        await eng.shutdown()
        return bad_outs, good_outs

    bad_outs, good_outs = asyncio.run(main())
    last = bad_outs[-1].outputs[0]
    assert last.finish_reason == "error" and "sampling failed" in last.error
    assert [t for o in good_outs for t in o.new_token_ids[0]] == ref.token_ids


def test_a_failed_forward_fails_that_step_and_the_engine_goes_on(tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = LLM(model=str(tiny_llama[0]), num_blocks_override=64).generate([[30, 31, 32, 33, 34]], sp)[0].outputs[0]

    async def main():
        eng = make_engine(tiny_llama[0])
        eng.start()
        runner = eng._engine.runner
        real = runner.forward

        def broken(*args):
            runner.forward = real  # fail once
            raise RuntimeError("device error")

        await eng.call(lambda e: setattr(runner, "forward", broken))
        (doomed,) = await eng.submit("doomed", [list(range(50, 70))], sp)
        outs = [o async for o in doomed]
        assert outs[-1].outputs[0].finish_reason == "error" and "device error" in outs[-1].outputs[0].error
        assert await eng.call(lambda e: e.kv.pool.cached) == {}  # its 5 full blocks were rolled back
        (after,) = await eng.submit("after", [[30, 31, 32, 33, 34]], sp)
        toks = [t async for o in after for t in o.new_token_ids[0]]
        await idle(eng)
        await eng.shutdown()
        return toks

    assert asyncio.run(main()) == ref.token_ids


def test_closing_a_stream_aborts_the_request(tiny_llama):
    async def main():
        eng = make_engine(tiny_llama[0])
        eng.start()
        (stream,) = await eng.submit("r", [list(range(5, 25))], SamplingParams(max_tokens=200, ignore_eos=True))
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await idle(eng)
        assert eng.num_unfinished == 0
        await eng.shutdown()

    asyncio.run(main())


def test_thousand_requests_with_random_aborts(tiny_llama):
    folder = tiny_llama[0]
    rng = random.Random(1234)
    specs = []
    for i in range(1000):
        prompt = [rng.randint(3, 319) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.3:  # shared prefixes exercise the cache under churn
            prompt = [7, 8, 9, 10, 11, 12, 13, 14] + prompt
        specs.append((f"r{i}", prompt, rng.randint(1, 12), rng.choice(["none", "none", "break", "cancel"]),
                      rng.randint(0, 5)))
    checked = {}

    async def one(eng: AsyncEngine, sem: asyncio.Semaphore, spec) -> str:
        rid, prompt, max_tokens, abort, after = spec
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async with sem:
            n = 0
            async for out in eng.generate(rid, prompt, sp):
                n += 1
                if abort == "break" and n > after:
                    return "aborted"
                if out.finished:
                    o = out.outputs[0]
                    assert o.finish_reason == "length" and len(o.token_ids) == max_tokens
                    checked[rid] = o.token_ids
                    return "finished"
            raise AssertionError(f"{rid}: stream ended without a finished output")

    async def main():
        eng = make_engine(folder, num_blocks_override=48, max_num_seqs=16, max_num_batched_tokens=64)
        eng.start()
        sem = asyncio.Semaphore(64)
        tasks = [asyncio.create_task(one(eng, sem, s)) for s in specs]
        for t, s in zip(tasks, specs):
            if s[3] == "cancel":
                asyncio.get_running_loop().call_later(rng.random() * 0.5, t.cancel)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            assert r in ("finished", "aborted") or isinstance(r, asyncio.CancelledError), repr(r)
        await idle(eng)
        assert eng.num_unfinished == 0 and eng.counters.step_errors == 0 and eng.dead is None
        await eng.shutdown()
        return results

    results = asyncio.run(main())
    assert results.count("finished") > 400
    assert results.count("aborted") > 50  # consumers that stopped reading
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) > 50  # cancelled tasks
    # Spot-check finished outputs against the offline engine (greedy is deterministic).
    llm = LLM(model=str(folder), num_blocks_override=64, block_size=4)
    sample = sorted(checked)[:20]
    refs = llm.generate([next(s[1] for s in specs if s[0] == rid) for rid in sample],
                        [SamplingParams(temperature=0, max_tokens=len(checked[rid]), ignore_eos=True)
                         for rid in sample])
    assert [r.outputs[0].token_ids for r in refs] == [checked[rid] for rid in sample]


def test_load_builds_warms_and_steps_on_one_thread(tiny_llama):
    """AsyncEngine.load: the model is built, warmed up and stepped on the engine
    thread (the main thread runs no torch); a failing build raises in the caller."""
    import threading

    from hotprefix.config import CacheConfig, EngineConfig, ModelConfig
    from hotprefix.engine.llm_engine import LLMEngine
    from hotprefix.model.arch import ModelLoadError

    seen: dict[str, threading.Thread] = {}

    def build() -> LLMEngine:
        seen["build"] = threading.current_thread()
        eng = LLMEngine(EngineConfig(ModelConfig(model=str(tiny_llama[0]), device="cpu"),
                                     CacheConfig(block_size=4, num_blocks_override=64)), warmup=False)
        real = eng.step

        def step(scheduled=None):
            seen["step"] = threading.current_thread()
            return real(scheduled)
        eng.step = step
        return eng

    ae = AsyncEngine.load(build)
    assert ae._engine.warmed and seen["build"] is not threading.current_thread()

    async def main():
        ae.start()
        outs = [o async for o in ae.generate("r", list(range(20, 30)), SamplingParams(max_tokens=3, ignore_eos=True))]
        await ae.shutdown()
        return outs

    assert asyncio.run(main())[-1].finished
    assert seen["step"] is seen["build"]
    with pytest.raises(ModelLoadError, match="does not exist"):
        AsyncEngine.load(lambda: LLMEngine(EngineConfig(ModelConfig(model="/no/such/model.gguf"))))


def test_tokenizer_copies_are_made_before_the_first_request(tiny_llama, monkeypatch):
    """Each preprocessing worker and the engine thread copy the tokenizer at start-up
    (a first request used to pay for the copies: 0.6 s on the default model), and no
    request makes another."""
    import threading

    from hotprefix.tokenizers import prompt_encoder as tok_mod

    engine = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=64).engine
    original = engine.encoder._original
    copies: list[str] = []
    real = tok_mod.copy.deepcopy

    def counted(x, *a):
        if x is original:
            copies.append(threading.current_thread().name)
        return real(x, *a)

    monkeypatch.setattr(tok_mod.copy, "deepcopy", counted)

    async def main():
        eng = AsyncEngine(engine, AdmissionConfig(preprocess_workers=3))
        made = sorted(copies)
        eng.start()
        await eng.call(lambda e: None)  # the engine thread has warmed up
        started = len(copies)
        outs = [o async for o in eng.generate("r", "Hello there, how are", SamplingParams(max_tokens=3))]
        await idle(eng)
        await eng.shutdown()
        return made, started, outs

    made, started, outs = asyncio.run(main())
    assert len(made) == 3 and len(set(made)) == 3 and all(n.startswith("hotprefix-prep") for n in made)
    assert started == 4 and copies[3] == "hotprefix-engine"
    assert len(copies) == 4 and outs[-1].finished
