"""What `hotprefix serve` spends before it listens: the tools' parsers (and their imports)
left out of an engine command's parser, and Python's cycle collector paused until the
server has started (cli.collector_paused)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from hotprefix.cli import ENGINE_COMMANDS, build_parser, collector_paused, named_command, subparser


def commands(parser) -> set[str]:
    return set(next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)).choices)


def test_an_engine_commands_parser_has_no_tool_in_it():
    assert commands(build_parser("serve")) == commands(build_parser("generate")) == set(ENGINE_COMMANDS)
    assert commands(build_parser("lint")) == commands(build_parser(None)) >= {*ENGINE_COMMANDS, "lint", "gateway"}
    # the serve parser is the same either way
    assert subparser(build_parser("serve"), "serve").format_help() == subparser(build_parser(), "serve").format_help()


@pytest.mark.parametrize(("argv", "command"), [
    (["serve", "--model", "lint"], "serve"), (["-v", "generate", "hi"], "generate"), (["--version"], None),
    (["-v", "lint", "log.jsonl"], "lint"), ([], None)])
def test_the_named_command_is_the_first_word_that_is_not_an_option(argv, command):
    assert named_command(argv) == command


def test_parsing_a_serve_command_line_imports_no_tool():
    code = ("import sys; from hotprefix.cli import build_parser, named_command; "
            "build_parser(named_command(['serve', '--port', '1'])).parse_args(['serve', '--port', '1']); "
            "print(sorted(m for m in sys.modules if m.startswith(('hotprefix.tools', 'hotprefix.gateway', 'httpx'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_collector_is_paused_until_the_server_has_started():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with collector_paused() as started:
            assert not gc.isenabled()
            started()
            assert gc.isenabled() and gc.get_freeze_count() > frozen
            started()  # (a second call changes nothing)
            assert gc.isenabled()
        assert gc.isenabled()
    finally:
        gc.unfreeze()  # (this test process's objects scanned again, as before)


def test_a_start_that_fails_turns_the_collector_back_on_and_freezes_nothing():
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("no model")
    assert gc.isenabled() and gc.get_freeze_count() == frozen
