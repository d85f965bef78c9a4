"""The request-log row: one type writes it (the server) and reads it (`hotprefix lint`); rows
as the server has always written them read the same; a malformed one is a one-line error
naming its field."""

from __future__ import annotations

import json

import pytest

from hotprefix.config import ConfigError
from hotprefix.server.request_log import KVShape, LogRow, LogRowError, LogStatus, PrefixEntry, RequestLog
from hotprefix.tools.lint import read_requests

# Two rows exactly as the server wrote them before the row was a type: with prefix caching
# (a salted prompt with its text, and an unfinished one), and without.
WRITTEN = [
    '{"time": 1779000000.5, "request_id": "cmpl-1", "endpoint": "completions", "model": "tiny", "user": "alice", '
    '"status": "ok", "prompt_tokens": 25, "cached_tokens": 16, "completion_tokens": 3, "ttft_s": 0.0123, '
    '"latency_s": 0.25, "finish_reason": "length", "kv": {"block_size": 4, "blocks": 256, "host_blocks": 8}, '
    '"prefix": [{"tokens": 20, "cached": 16, "completion": 3, "blocks": ["00ff", "a1b2"], "salt": "c0ffee", '
    '"salt_offset": 8, "text": "hello"}, {"tokens": 5, "cached": 0, "completion": 0, "blocks": null, '
    '"salt": null}]}',
    '{"time": 1779000001, "request_id": "chatcmpl-2", "endpoint": "chat.completions", "model": "tiny", '
    '"user": null, "status": "client_disconnected", "prompt_tokens": 9, "cached_tokens": 0, '
    '"completion_tokens": 0, "ttft_s": null, "latency_s": 0.01, "finish_reason": "abort"}',
]


def test_rows_the_server_wrote_read_and_write_back_the_same():
    first, second = (LogRow.from_json(json.loads(line)) for line in WRITTEN)
    assert first.kv == KVShape(4, 256, 8) and first.status is LogStatus.OK and first.user == "alice"
    assert first.prefix == (PrefixEntry(20, 16, 3, ("00ff", "a1b2"), "c0ffee", 8, "hello"),
                            PrefixEntry(5, 0, 0, None))
    assert first.arrival == 1779000000.25
    assert (second.kv, second.prefix, second.ttft_s) == (None, None, None)
    assert second.status is LogStatus.CLIENT_DISCONNECTED
    assert [json.dumps(r.to_json()) for r in (first, second)] == WRITTEN


@pytest.mark.parametrize(("change", "message"), [
    ({"status": "done"}, "whose `status` is malformed: status must be one of ok, error, client_disconnected, "
                         'got "done"'),
    ({"prompt_tokens": -1}, "whose `prompt_tokens` is malformed: prompt_tokens must be an integer >= 0, got -1"),
    ({"user": 7}, "whose `user` is malformed: user must be null or a string, got 7"),
    ({"prefix": [{"tokens": 3, "blocks": ["0g"]}]}, "whose `prefix` or times are malformed: prefix[0].blocks "
                                                    'must be null or a list of hex digests, got ["0g"]'),
    ({"kv": {"blocks": 4}}, "whose `prefix` or times are malformed: kv.block_size must be an integer >= 1, "
                            "got missing"),
    ({"kv": {"block_size": 4, "blocks": 9, "windows": [8, None]}}, "whose `prefix` or times are malformed: "
     "kv.windows must be null, then 1 to 1023 windows of 1 to 2^24 tokens, got [8, null]"),
])
def test_a_malformed_row_is_one_line_naming_its_field(change, message, tmp_path):
    row = json.loads(WRITTEN[0]) | change
    with pytest.raises(LogRowError) as e:
        LogRow.from_json(row)
    assert str(e.value) == "a request-log row " + message
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as e:
        read_requests(path)
    assert str(e.value) == f"{path}:1: a request-log row {message}"


def test_lint_reads_the_rows_in_arrival_order(tmp_path):
    late = json.loads(WRITTEN[0]) | {"request_id": "cmpl-3", "time": 1779000002.0, "latency_s": 0.1}
    late["prefix"] = [{"tokens": 8, "cached": 4, "completion": 1, "blocks": ["ee"], "salt": None}]
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(late) + "\n" + WRITTEN[0] + "\n")
    data = read_requests(path)
    assert [e.tokens for e in data.entries] == [20, 8]  # the unfinished prompt has no chain: not replayed
    assert data.block_size == 4 and (data.size.device_blocks, data.size.host_blocks) == (256, 8)


@pytest.mark.parametrize("before", ["", WRITTEN[0] + "\n"])
@pytest.mark.parametrize("torn_bytes", [1, 70_000])  # within the last 64 KiB read back, and across it
def test_a_row_torn_by_a_kill_is_cut_when_the_log_opens_again(tmp_path, caplog, before, torn_bytes):
    """A server killed mid-write leaves a last line without its newline; the next start
    cuts it (the next row would be glued to it, and lint would refuse the log at that line)."""
    path = tmp_path / "log.jsonl"
    torn = (WRITTEN[1] * (torn_bytes // len(WRITTEN[1]) + 1))[:torn_bytes]
    path.write_text(before + torn)
    log = RequestLog(str(path))
    log.write(LogRow.from_json(json.loads(WRITTEN[0])))
    log.close()
    assert path.read_text() == before + WRITTEN[0] + "\n"
    assert f"dropped a torn last row ({torn_bytes} bytes without a newline" in caplog.text
    assert [e.tokens for e in read_requests(path).entries] == [20] * (2 if before else 1)


def test_lint_skips_an_unfinished_last_line_and_refuses_a_broken_one_before_it(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_text(WRITTEN[0] + "\n" + WRITTEN[1][:40])  # a writer killed (or still writing) mid-line
    assert [e.tokens for e in read_requests(path).entries] == [20]
    assert f"{path}:2: an unfinished last line (no newline;" in caplog.text
    path.write_text(WRITTEN[0] + "\n" + WRITTEN[1][:40] + "\n" + WRITTEN[0] + "\n")  # ended: a broken row
    with pytest.raises(ConfigError) as e:
        read_requests(path)
    assert str(e.value).startswith(f"{path}:2: ")


def test_an_intact_log_opens_untouched(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_text(WRITTEN[0] + "\n")
    RequestLog(str(path)).close()
    assert path.read_text() == WRITTEN[0] + "\n" and "torn" not in caplog.text


def test_a_grouped_pools_groups_travel_from_the_row_to_lints_replay(tmp_path):
    """A window model's server writes its pool's KV-cache groups and retention interval in the
    row's `kv`; lint replays the grouped pool they describe."""
    kv = KVShape(4, 105, 0, 2048, (None,) + (8,) * 6, 4096)
    row = json.loads(WRITTEN[0]) | {"kv": kv.to_json()}
    assert row["kv"]["windows"] == [None, 8, 8, 8, 8, 8, 8] and row["kv"]["retain_every"] == 4096
    assert LogRow.from_json(row).kv == kv
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(row) + "\n")
    size = read_requests(path).size
    assert (size.device_blocks, size.windows, size.retain_every) == (105, kv.windows, 4096) and size.grouped
