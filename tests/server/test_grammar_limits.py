"""Output constraints no request can make expensive: size limits checked before compiling
(each a 400 naming its flag), a compiler process killed when it runs over its CPU budget,
and a tenant's share of the preprocessing workers."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from hotprefix.errors import InvalidRequestError
from hotprefix.grammar import GrammarCompiler
from hotprefix.grammar_limits import GrammarLimits, repeat_product
from hotprefix.grammar_sandbox import CompileSandbox, SandboxConfig
from hotprefix.sampling_params import StructuredKind, StructuredOutput
from tests.conftest import build_tokenizer


def schema_of(n_props: int = 0, enum: int = 0, depth: int = 0, pattern: str | None = None) -> str:
    node: dict = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n_props)}}
    if enum:
        node["properties"]["e"] = {"enum": [f"v{i}" for i in range(enum)]}
    if pattern:
        node["properties"]["r"] = {"type": "string", "pattern": pattern}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}}
    return json.dumps(node)


ATTACKS = {  # the bodies that held the server, at the default limits: refused at once
    "15,000 properties (600 KB)": ("json_schema", schema_of(15_000), "--max-grammar-bytes"),
    "60,000 enum values": ("json_schema", schema_of(enum=60_000), "--max-grammar-bytes"),
    "(a{1000}){1000}": ("regex", "(a{1000}){1000}", "--max-grammar-repeat"),
}


@pytest.mark.parametrize("name", ATTACKS)
def test_the_attack_bodies_are_refused_by_the_default_limits(name):
    kind, spec, flag = ATTACKS[name]
    with pytest.raises(InvalidRequestError) as e:
        GrammarLimits().check(kind, spec)
    assert flag in str(e.value) and e.value.param == kind


@pytest.mark.parametrize("spec,flag", [
    (schema_of(5_001), "--max-grammar-properties"),
    (schema_of(enum=1_001), "--max-grammar-enum-values"),
    (schema_of(depth=40), "--max-grammar-depth"),
    (schema_of(pattern="(x{101}){100}"), "--max-grammar-repeat"),
])
def test_each_limit_is_named(spec, flag):
    roomy = GrammarLimits(max_spec_bytes=1 << 30)
    with pytest.raises(InvalidRequestError, match=flag):
        roomy.check("json_schema", spec)


def test_what_users_send_passes():
    lim = GrammarLimits()
    lim.check("json_schema", schema_of(200, enum=100, depth=5, pattern="[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    lim.check("regex", r"(\d{3}-){2}\d{4}")
    lim.check("json_schema", "not json")  # (the compiler says what is wrong with it)


@pytest.mark.parametrize("regex,product", [
    (r"\d{4}-\d{2}", 4), ("[a-z]{1,64}", 64), (r"(\d{3}){3}", 9), ("(a{1000}){1000}", 1_000_000),
    ("((a{10}){10}){10}", 1000), ("abc", 1), ("(a|b){5,}", 5), ("x{2}(y{3})", 3), (r"\{5\}", 1),
    ("[{]{9}", 9), ("((a{7})", 7),
])
def test_repeat_product(regex, product):
    assert repeat_product(regex) == product


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def sandbox_for(tok, budget: float) -> CompileSandbox:
    return CompileSandbox(SandboxConfig(320, (tok.eos_token_id,), budget, workers=1), tok.backend_tokenizer.to_str)


def test_a_compile_over_its_cpu_budget_is_killed_and_the_next_one_works(tokenizer):
    """The 15,000-property schema with the limits lifted: its compile runs in the worker
    process until the CPU budget (0.5 s here) is spent, the worker is killed, the call is a
    400 naming the flag; a new worker compiles the next spec."""
    sandbox = sandbox_for(tokenizer, 0.5)
    compiler = GrammarCompiler(tokenizer, 320, GrammarLimits(max_spec_bytes=1 << 30, max_properties=10**6), sandbox)
    try:
        with pytest.raises(InvalidRequestError, match="--max-grammar-compile-seconds") as e:
            compiler.compile(StructuredOutput(StructuredKind.JSON_SCHEMA, schema_of(15_000)))
        assert "took more than 0.5s of CPU time" in str(e.value) and sandbox.killed == 1
        so = compiler.compile(StructuredOutput(StructuredKind.JSON_SCHEMA, schema_of(3)))
        assert so.grammar and compiler.new_matcher(so) is not None
        with pytest.raises(InvalidRequestError, match="invalid regex"):  # the spec's own error, from the worker
            compiler.compile(StructuredOutput(StructuredKind.REGEX, "(unclosed"))
        assert sandbox.killed == 1
        sandbox.close()  # (the engine's close) stops the workers; a later compile starts one again
        assert compiler.compile(StructuredOutput(StructuredKind.JSON_SCHEMA, schema_of(4))).grammar
    finally:
        sandbox.close()


def test_a_tenant_holds_at_most_half_of_the_preprocessing_workers(tiny_llama):
    """Two slow requests of one tenant and one of another: the other's is prepared
    while the first tenant's second waits for its share."""
    from hotprefix.config import AdmissionConfig, CacheConfig, EngineConfig, ModelConfig
    from hotprefix.engine.async_engine import AsyncEngine
    from hotprefix.engine.llm_engine import LLMEngine
    from hotprefix.engine.requests import RequestOptions
    from hotprefix.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(ModelConfig(model=str(tiny_llama[0])), CacheConfig(num_blocks_override=32)))
    ae = AsyncEngine(engine, AdmissionConfig(preprocess_workers=2, preprocess_timeout=30))
    release, started = threading.Event(), []
    real = engine.prepare_request

    def slow(rid, prompt, *a, **k):
        started.append(prompt)
        if prompt == "slow":
            release.wait(20)
        return real(rid, prompt, *a, **k)

    engine.prepare_request = slow

    async def go():
        ae.start()
        p = SamplingParams(max_tokens=1)
        a1 = asyncio.ensure_future(ae.submit("a1", ["slow"], p, RequestOptions(tenant="acme")))
        a2 = asyncio.ensure_future(ae.submit("a2", ["slow"], p, RequestOptions(tenant="acme")))
        freed = ae._prep.shares._freed
        for _ in range(2000):  # until acme's second waits on the share (a state, not a time)
            if started == ["slow"] and len(getattr(freed, "_waiters", ())) == 1:
                break
            await asyncio.sleep(0.01)
        assert started == ["slow"] and ae._prep.shares.busy == {"acme": 1}  # acme's second waits for its share
        assert len(freed._waiters) == 1
        streams = await asyncio.wait_for(ae.submit("b", ["hi"], p, RequestOptions(tenant="beta")), 10)
        assert started == ["slow", "hi"]  # beta was prepared on the other worker meanwhile
        release.set()
        for s in streams + await a1 + await a2:
            async for _ in s:
                pass
        assert ae._prep.shares.busy == {}
        await ae.shutdown()

    asyncio.run(go())


def test_a_worker_whose_parent_went_away_exits_quietly(tokenizer):
    """A process that exits without closing its sandbox (a script's LLM) leaves its workers a
    pipe at its end: they exit with status 0 and no traceback (they printed EOFError's)."""
    from hotprefix.grammar_sandbox import _Worker

    cfg = SandboxConfig(320, (tokenizer.eos_token_id,), 5.0, workers=1)
    w = _Worker(cfg, tokenizer.backend_tokenizer.to_str())
    w.wait_ready()
    w.conn.close()  # as the parent's exit closes it
    assert w.proc.wait(60) == 0


def test_a_worker_that_cannot_start_is_a_clear_error_at_once(tokenizer):
    """A worker that fails to start (here: a tokenizer llguidance cannot read) says why and
    the call raises it; the sandbox starts a new worker for the next call."""
    sandbox = CompileSandbox(SandboxConfig(320, (tokenizer.eos_token_id,), 5.0, workers=1), lambda: "not json")
    try:
        with pytest.raises(RuntimeError, match="^the grammar compiler process did not start: ") as e:
            sandbox.grammar(StructuredKind.REGEX, "a")
        assert "Error" in str(e.value) and sandbox.killed == 1
        sandbox.tokenizer_json = tokenizer.backend_tokenizer.to_str
        assert sandbox.grammar(StructuredKind.REGEX, "a")
    finally:
        sandbox.close()


def test_a_worker_that_cannot_be_made_frees_its_place(tokenizer):
    """The tokenizer's JSON cannot be made: the call raises that, and the sandbox's one
    place is free again for the next call (else every later call would wait for it)."""
    def broken() -> str:
        raise OSError("no tokenizer")

    sandbox = CompileSandbox(SandboxConfig(320, (tokenizer.eos_token_id,), 5.0, workers=1), broken)
    try:
        with pytest.raises(OSError, match="no tokenizer"):
            sandbox.grammar(StructuredKind.REGEX, "a")
        assert sandbox._count == 0
        sandbox.tokenizer_json = tokenizer.backend_tokenizer.to_str
        assert sandbox.grammar(StructuredKind.REGEX, "a")
    finally:
        sandbox.close()


def test_a_worker_that_dies_while_starting_is_a_clear_error(tokenizer):
    """A worker killed before it is ready: the parent says so (it never waits for it)."""
    import signal

    from hotprefix.grammar_sandbox import _Worker

    w = _Worker(SandboxConfig(320, (tokenizer.eos_token_id,), 5.0, workers=1), tokenizer.backend_tokenizer.to_str())
    w.proc.send_signal(signal.SIGKILL)
    with pytest.raises(RuntimeError, match="^the grammar compiler process did not start: it was killed by signal 9$"):
        w.wait_ready()
    w.kill()


def test_the_worker_module_imports_neither_torch_nor_transformers():
    """What the worker process imports: the compiler, not torch (nor transformers)."""
    import subprocess
    import sys

    code = "import sys, hotprefix.grammar_worker; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_tokenizer_json_leaves_out_padding_and_truncation_and_changes_nothing(tmp_path):
    """The JSON the sandbox's workers get: the tokenizer's own when it neither pads nor
    truncates; else a copy's without them, the tokenizer itself still padding."""
    from hotprefix.grammar import tokenizer_json

    tok = build_tokenizer(tmp_path)
    b = tok.backend_tokenizer
    assert tokenizer_json(tok) == b.to_str()
    plain = b.to_str()
    b.enable_padding(length=8)
    b.enable_truncation(16)
    assert tokenizer_json(tok) == plain
    assert b.padding is not None and b.truncation is not None
