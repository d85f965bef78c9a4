"""Flags declared once (hotprefix/flags.py): the parsers, their --help, the LLM() keywords
and the configs all come from the declarations on the config fields, with one default
and one unit per flag; the --help blocks in the docs are the parsers' own."""

from __future__ import annotations

import argparse
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotprefix.cli import (
    GenerateOptions,
    build_parser,
    engine_config_from_args,
    serve_flags,
    server_config_from_args,
    subparser,
)
from hotprefix.config import CacheConfig, ConfigError, EngineConfig, ServerConfig
from hotprefix.flags import add_flags, build, declared, flag, given, take_keywords
from hotprefix.vllm_flags import ForeignFlags, expand_config

ROOT = Path(__file__).resolve().parents[2]
SERVE_CLASSES = (EngineConfig, ServerConfig, ForeignFlags)


def parse(command: str, args: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(expand_config([command, *args], serve_flags(parser)))


def test_a_command_line_without_flags_gives_the_fields_own_defaults(monkeypatch):
    monkeypatch.delenv("HOTPREFIX_API_KEY", raising=False)
    a = parse("serve", [])
    assert engine_config_from_args(a) == EngineConfig()
    assert server_config_from_args(a) == ServerConfig()
    assert build(ForeignFlags, given(a, ForeignFlags)).lines() == []
    g = parse("generate", ["x"])
    assert engine_config_from_args(g) == EngineConfig()
    assert build(GenerateOptions, given(g, GenerateOptions)) == GenerateOptions()


def test_the_environment_gives_the_api_key_unless_the_flag_does(monkeypatch):
    monkeypatch.setenv("HOTPREFIX_API_KEY", "from-env")
    assert server_config_from_args(parse("serve", [])).api_key == "from-env"
    assert server_config_from_args(parse("serve", ["--api-key", "flag"])).api_key == "flag"


@pytest.mark.parametrize("args,keywords,field,value", [
    (["--swap-space", "4"], {"swap_space": 4}, "swap_space", 4 << 30),
    (["--swap-space", "0.5"], {"swap_space": 0.5}, "swap_space", 1 << 29),
    (["--swap-space", "512MiB"], {"swap_space": "512MiB"}, "swap_space", 512 << 20),
    (["--kv-offloading-size", "2"], {"kv_offloading_size": 2}, "kv_offloading_size", 2 << 30),
    (["--kv-disk-size", "1.5"], {"kv_disk_size": "1.5"}, "kv_disk_size", 3 << 29),
    (["--kv-cache-memory-bytes", "2000"], {"kv_cache_memory_bytes": 2000}, "kv_cache_memory", 2000),
    (["--kv-cache-memory", "2GiB"], {"kv_cache_memory": "2GiB"}, "kv_cache_memory", 2 << 30),
    (["--num-gpu-blocks-override", "7"], {"num_gpu_blocks_override": 7}, "num_blocks_override", 7),
    (["--num-gpu-blocks-override", "7"], {"num_blocks_override": 7}, "num_blocks_override", 7),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}, "enable_prefix_caching", False),
])
def test_a_flag_and_its_llm_keyword_mean_the_same(args, keywords, field, value):
    from_flag = engine_config_from_args(parse("serve", args)).cache
    kwargs = dict(keywords)
    from_keyword = build(EngineConfig, take_keywords(kwargs, EngineConfig)).cache
    assert kwargs == {}  # every keyword was taken
    assert getattr(from_flag, field) == getattr(from_keyword, field) == value
    assert from_flag == from_keyword == CacheConfig(**{field: value})


def test_other_units_and_spellings_convert_by_their_declaration(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    a = parse("serve", ["--dashboard-window", "2", "--max-request-body-bytes", "1MiB", "--allowed-origins",
                        "a.com, b.com", "--allowed-methods", '["GET"]', "--served-model-name", "x", "y",
                        "--chat-template", str(template), "--disable-log-stats", "--disable-fastapi-docs",
                        "--dtype", "half", "--max-model-len", "2k", "-v"])
    s, e = server_config_from_args(a), engine_config_from_args(a)
    assert (s.dashboard_window, s.max_request_body_bytes, s.allowed_origins, s.allowed_methods) == \
        (120.0, 1 << 20, ("a.com", "b.com"), ("GET",))
    assert (s.served_model_names, s.chat_template, s.log_stats, s.docs, s.log_level) == \
        (("x", "y"), "{{ messages }}", False, False, "debug")
    assert (e.model.dtype, e.model.max_model_len) == ("float16", 2000)
    g = build(GenerateOptions, given(parse("generate", ["--stop", "a", "--stop", "b", "--sampling-seed", "3"]),
                                     GenerateOptions))
    assert (g.stop, g.sampling_params().stop, g.sampling_params().seed) == (("a", "b"), ("a", "b"), 3)


@pytest.mark.parametrize("keywords,error", [
    ({"swap_space": "lots"}, "cannot parse memory size 'lots'"),
    ({"swap_space": float("nan")}, "not a size in GiB"),
    ({"swap_space": -1}, "--swap-space must be >= 0"),
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be >= 1"),
])
def test_bad_values_are_config_errors(keywords, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        build(EngineConfig, take_keywords(dict(keywords), EngineConfig))


def test_two_keywords_for_one_field_and_unknown_keywords():
    with pytest.raises(TypeError, match="both set kv_cache_memory"):
        take_keywords({"kv_cache_memory": 1, "kv_cache_memory_bytes": 2}, EngineConfig)
    kwargs = {"block_size": 8, "trust_remote_code": True, "no_such": 1}
    assert take_keywords(kwargs, EngineConfig) == {"block_size": 8}
    assert take_keywords(kwargs, ForeignFlags) == {"trust_remote_code": True}
    assert kwargs == {"no_such": 1}  # what LLM() refuses with TypeError


def test_a_disable_switch_is_no_keyword_of_its_field():
    kwargs = {"disable_log_stats": True, "log_stats": False}
    assert take_keywords(kwargs, ServerConfig) == {"log_stats": False} and kwargs == {"disable_log_stats": True}


def test_vllm_keywords_with_no_effect_are_named_or_refused():
    foreign = build(ForeignFlags, take_keywords({"trust_remote_code": True, "pipeline_parallel_size": 1,
                                                 "quantization": None}, ForeignFlags))
    assert foreign.lines() == [
        "--pipeline-parallel-size 1: accepted, no effect here (one pipeline stage: the whole model runs in one "
        "engine)",
        "--trust-remote-code: accepted, no effect here (hotprefix runs no code from a model repository: it "
        "implements the architectures it loads (Llama-family) itself)"]
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2: hotprefix runs one engine per device"):
        build(ForeignFlags, {"pipeline_parallel_size": 2})


def test_the_declarations_are_consistent():
    decls = [d for cls in (*SERVE_CLASSES, GenerateOptions) for d in declared(cls)]
    names = [d.name for d in decls]
    assert len(names) == len(set(names))  # one field per name: keywords and values are keyed by it
    keywords = [k for d in decls for k in d.keywords]
    assert len(keywords) == len(set(keywords))
    serve = [d for cls in SERVE_CLASSES for d in declared(cls)]
    assert len({d.dest for d in serve}) == len(serve)  # (argparse would let two flags share one attribute)
    assert len(serve) >= 85  # (all of them: a class left out of SERVE_CLASSES would pass vacuously)
    option_strings = {s for d in serve for s in d.names}
    assert option_strings <= serve_flags(build_parser())


def test_a_switch_that_cannot_turn_its_default_around_is_refused():
    @dataclass(frozen=True)
    class Bad:
        on: bool = flag(True, "already on")

    with pytest.raises(TypeError, match="Bad.on"):
        declared(Bad)


def _help_blocks(help_text: str) -> list[str]:
    """Each option's entry in a --help text (its lines up to the next option or section)."""
    return re.split(r"\n(?=  -|\n)", help_text)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_says_each_default_once(command):
    text = subparser(build_parser(), command).format_help()
    blocks = _help_blocks(text)
    assert all(b.count("(default") <= 1 for b in blocks), [b for b in blocks if b.count("(default") > 1]
    classes = SERVE_CLASSES if command == "serve" else (EngineConfig, GenerateOptions)
    decls = [d for cls in classes for d in declared(cls)]
    assert not [d.name for d in decls if "(default" in d.flag.help]  # the declared help never says it itself
    shown = [d for d in decls if "(default: " in d.help_text()]
    # (generate's positional prompt says what it reads without one)
    assert text.count("(default:") == len(shown) + (command == "generate")
    assert ("(default: 1024)" if command == "serve" else "(default: 64)") in text


def _docs_module():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_help_blocks_are_generated_from_the_declarations():
    docs = _docs_module()
    assert docs.stale() == []  # else: run `make docs`
    for command, path in docs.BLOCKS.items():
        text = path.read_text()
        assert docs.help_text(command) in text
        edited = text.replace("(default: 16)", "(default: 32)", 1)  # a flag's help changed without regenerating
        assert edited != text and docs.rendered(edited, command) == text


def test_adding_a_declared_field_adds_its_flag_and_keyword():
    """What 'adding a serve flag touches the field and its use' rests on: the parser, the
    values and the keywords follow the declaration, with nothing else to edit."""
    @dataclass(frozen=True)
    class Extra:
        widget_bytes: int = flag(1 << 20, "bytes of widgets")

    parser = argparse.ArgumentParser()
    add_flags(parser, Extra)
    a = parser.parse_args(["--widget-bytes", "5"])
    assert build(Extra, given(a, Extra)) == Extra(5) and build(Extra, given(parser.parse_args([]), Extra)) == Extra()
    assert take_keywords({"widget_bytes": 3}, Extra) == {"widget_bytes": 3}
    assert "bytes of widgets (default: 1048576)" in parser.format_help()
