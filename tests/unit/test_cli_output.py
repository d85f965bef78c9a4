"""What the command line prints: each default said once in every --help, and the usage
table's money as plain decimals."""

from __future__ import annotations

import re

import pytest

from hotprefix.cli import build_parser, subparser
from hotprefix.gateway.cli import _cell

COMMANDS = ["serve", "generate", "gateway", "tenants", "keys", "usage", "size", "lint", "logs", "watch", "bench"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_says_each_default_once(command):
    text = " ".join(subparser(build_parser(), command).format_help().split())
    assert not re.search(r"\(default:[^()]*(\([^()]*\)[^()]*)*\) \(default:", text), text
    assert "(default: None)" not in text


def test_the_gateways_help_says_its_defaults():
    text = " ".join(subparser(build_parser(), "gateway").format_help().split())
    assert text.count("(default: 2.0)") == 1 and "--port PORT port to listen on (default: 8080)" in text
    assert "(default: in this process)" in text and "in this process) (default" not in text


def test_money_is_a_plain_decimal():
    assert [_cell(v) for v in (3e-05, 0.1 + 0.2, 12.5, 4, None, "k")] == [
        "0.00003", "0.30000000000000004", "12.5", "4", "", "k"]
