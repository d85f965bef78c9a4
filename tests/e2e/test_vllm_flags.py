"""Every flag of `vllm serve --help` (vLLM 0.32 and 0.33, kept in vllm_serve_flags.txt with
where it was read) is taken by `hotprefix serve`, in every spelling: honoured (it lands on
a config field), or named at start-up with why it has no effect here, or refused with why.
An unknown flag prints serve's usage; on a CPU the GPU-only flags given are named."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hotprefix.cli import build_parser, main, serve_flags, subparser
from hotprefix.config import ConfigError, EngineConfig, ServerConfig
from hotprefix.flags import declared
from hotprefix.vllm_flags import ForeignFlags, check_foreign, expand_config, inert_lines

LIST = Path(__file__).with_name("vllm_serve_flags.txt")


def vllm_flags() -> list[tuple[tuple[str, ...], str, tuple[str, ...]]]:
    """(versions, option strings, the value to give: None for a switch) of every line."""
    rows = []
    for line in LIST.read_text().splitlines():
        if line and not line.startswith("#"):
            versions, names, value = line.split("\t")
            rows.append((tuple(versions.split(",")), tuple(names.split()), value))
    return rows


def test_the_list_is_both_versions_whole():
    rows = vllm_flags()
    assert len(rows) == 320 and sum("0.32" in v for v, _, _ in rows) == 316 and sum("0.33" in v for v, _, _ in rows) \
        == 320
    assert len({n for _, names, _ in rows for n in names}) == sum(len(names) for _, names, _ in rows)


def _args(name: str, value: str, tmp_path: Path) -> list[str]:
    if value == "-":
        return [name]
    if value == "FILE":
        (tmp_path / "c.yaml").write_text("{}\n")
        return [name, str(tmp_path / "c.yaml")]
    return [name, *(value.split(" ") if value != "''" else [""])]


def _owners() -> dict[str, str]:
    """Option string -> how hotprefix takes it: 'honoured' (a config field) or 'foreign'."""
    out = {}
    for cls, kind in ((EngineConfig, "honoured"), (ServerConfig, "honoured"), (ForeignFlags, "foreign")):
        for d in declared(cls):
            out |= dict.fromkeys([*d.names, *d.off_names], kind)
    return out | {"--config": "honoured"}


@pytest.mark.parametrize("versions,names,value", vllm_flags(), ids=lambda x: x[0] if isinstance(x, tuple) else None)
def test_every_spelling_is_honoured_named_or_refused_with_why(versions, names, value, tmp_path):
    owners, parser = _owners(), build_parser()
    for name in names:
        assert name in owners, f"{name} (vLLM {', '.join(versions)}) is not declared"
        a = parser.parse_args(expand_config(["serve", *_args(name, value, tmp_path)], serve_flags(parser)))
        try:
            lines = check_foreign(a)
        except ConfigError as e:  # refused: the message names the flag and says why
            assert owners[name] == "foreign" and str(e).split(":")[0].split(" ")[0] in names and len(str(e)) > 40
            continue
        if owners[name] == "foreign":
            (line,) = lines
            assert line.split(" ")[0].rstrip(":") in names and "accepted, no effect here (" in line, line
        else:
            assert lines == []


def test_a_value_that_would_change_results_is_refused_and_a_harmless_one_named():
    parser = build_parser()
    for args, why in ((["-dp", "2"], "one engine per device"), (["--reasoning-parser", "deepseek_r1"], "thoughts"),
                      (["--hf-overrides", '{"rope_theta": 1}'], "change the model"), (["--grpc"], "HTTP"),
                      (["--logits-processors", "my.Proc"], "change the tokens")):
        with pytest.raises(ConfigError, match=why):
            check_foreign(parser.parse_args(["serve", *args]))
    lines = check_foreign(parser.parse_args(["serve", "-dp", "1", "--no-grpc", "--disable-dbo", "--enable-eplb"]))
    assert [line.split(":")[0] for line in lines] == ["--data-parallel-size 1", "--enable-eplb", "--no-enable-dbo",
                                                      "--no-grpc"]


def test_the_spellings_of_a_switch_set_its_field():
    parser = build_parser()

    def parsed(*args: str) -> argparse.Namespace:
        return parser.parse_args(["serve", *args])

    for args, caching in (([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
                          (["--disable-prefix-caching"], False)):
        assert parsed(*args).enable_prefix_caching is caching
    assert [parsed(x).disable_fastapi_docs for x in ("--disable-fastapi-docs", "--no-disable-fastapi-docs",
                                                     "--enable-fastapi-docs")] == [True, False, False]
    assert parsed("--cudagraph-capture-sizes", "1", "2").cuda_graph_sizes == ["1", "2"]


def test_an_unknown_flag_prints_serves_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--frobnicate"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: hotprefix serve ")
    assert err.rstrip().endswith("hotprefix serve: error: unrecognized arguments: --frobnicate")
    assert subparser(build_parser(), "serve").prog == "hotprefix serve"


def test_on_a_cpu_the_gpu_only_flags_given_are_named():
    parser = build_parser()
    a = parser.parse_args(["serve", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--cuda-graph-sizes", "1",
                           "2", "--swap-space", "8", "--max-model-len", "512"])
    from hotprefix.cli import engine_config_from_args

    cfg = engine_config_from_args(a)
    lines = inert_lines(a, cfg, cpu=True)
    assert [line.split(":")[0] for line in lines] == ["--enforce-eager", "--cuda-graph-sizes 1 2",
                                                      "--gpu-memory-utilization 0.5", "--swap-space 8"]
    assert all("accepted, no effect here (" in line for line in lines)
    assert [line.split(":")[0] for line in inert_lines(a, cfg, cpu=False)] == ["--swap-space 8"]  # (recompute)
    assert inert_lines(parser.parse_args(["serve"]), cfg, cpu=True) == []
