"""The liveness protocol (hpc_rlhf.dist.liveness): the failure line, records and heartbeats through a real
TCPStore, and the error file that a locally launched rank leaves for its launcher."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest

from hpc_rlhf.dist import liveness


@pytest.fixture
def records():
    """A store as the ranks see it: a client of a TCPStore, under this attempt's key prefix."""
    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    client = TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                      timeout=timedelta(seconds=5))
    yield PrefixStore(liveness.key_prefix(), client)


def test_the_failure_line_names_rank_role_phase_and_step():
    record = liveness.failure_record(3, "rollout", "scoring", 2, "failed", "RuntimeError: boom", primary=True, by=3)
    assert liveness.format_failure(record, seen_by=0) == \
        "hpc_rlhf: rank 3 (role rollout) failed during scoring: RuntimeError: boom [step 2; seen by rank 0]"
    assert liveness.format_failure(record, seen_by=3).endswith("[step 2]")


def test_published_records_are_read_back_in_order_and_counted(records):
    assert liveness.failure_count(records) == 0
    first = liveness.failure_record(1, "critic", "training", 4, "failed", "its process is gone", primary=True, by=0)
    second = liveness.failure_record(2, "ref", "exchange", 4, "failed", "Connection closed by peer", primary=False,
                                     by=2)
    liveness.publish(records, first)
    liveness.publish(records, second)
    assert liveness.failure_count(records) == 2
    assert liveness.read_failures(records) == ([first, second], [])


def test_a_line_of_the_failure_log_that_is_not_a_record_is_skipped_and_named(records):
    """Something else wrote to the log (another user on the store's port, a torn append): the records around it
    still count, and each bad line is named."""
    first = liveness.failure_record(1, "critic", "training", 4, "failed", "its process is gone", primary=True, by=0)
    liveness.publish(records, first)
    records.append(liveness.FAILURE_LOG, "rank 3 is dead, stop everything\n")
    records.append(liveness.FAILURE_LOG, '{"rank": "3", "primary": true}\n')
    records.append(liveness.FAILURE_LOG, "[" * 100_000 + "\n")
    liveness.publish(records, dict(first, rank=2))
    found, bad = liveness.read_failures(records)
    assert found == [first, dict(first, rank=2)]
    assert bad[0] == "line 2 of the failure log: not JSON (JSONDecodeError)"
    assert bad[1].startswith("line 3 of the failure log: field 'rank' is '3', not int")
    assert bad[2].startswith("line 4 of the failure log: 100000 bytes, more than")


@pytest.mark.parametrize("value, says", [
    (b"garbage", "not JSON"), (b"[1, 2]", "a JSON list, not an object"),
    (b'{"seq": true, "role": "actor"}', "field 'seq' is True, not int"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_heartbeat_that_is_not_one_raises_record_error(records, value, says):
    records.set(liveness.heartbeat_key(2), value)
    with pytest.raises(liveness.RecordError, match=rf"^the heartbeat of rank 2: {re.escape(says)}"):
        liveness.read_heartbeat(records, 2)


def test_a_heartbeat_is_read_as_written_and_a_missing_one_is_none(records):
    assert liveness.read_heartbeat(records, 5) is None
    records.set(liveness.heartbeat_key(5), liveness.heartbeat(7, "actor", "scoring", 3, "node1", 4242, "pid:[1]",
                                                              liveness.RUNNING))
    assert liveness.read_heartbeat(records, 5) == {"seq": 7, "role": "actor", "phase": "scoring", "step": 3,
                                                   "host": "node1", "pid": 4242, "pidns": "pid:[1]",
                                                   "state": "running"}


def test_each_torchrun_restart_has_its_own_prefix(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert liveness.key_prefix() == "hpc_rlhf/watchdog/0"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert liveness.key_prefix() == "hpc_rlhf/watchdog/2"


def test_the_error_file_holds_the_message_and_time(tmp_path, monkeypatch):
    path = tmp_path / "rank1.json"
    monkeypatch.setenv(liveness.ERROR_FILE_VAR, str(path))
    liveness.record_failure("RuntimeError: lost the data")
    when, message = liveness.read_recorded_failure(path)
    assert message == "RuntimeError: lost the data" and when == json.loads(path.read_text())["time"]


def test_no_error_file_is_written_without_the_variable_and_a_broken_one_reads_as_none(tmp_path, monkeypatch):
    monkeypatch.delenv(liveness.ERROR_FILE_VAR, raising=False)
    liveness.record_failure("nobody asked")  # a no-op, not an error
    assert list(tmp_path.iterdir()) == []
    assert liveness.read_recorded_failure(tmp_path / "absent.json") is None
    (tmp_path / "broken.json").write_text("{not json")
    assert liveness.read_recorded_failure(tmp_path / "broken.json") is None
    unwritable = tmp_path / "missing-folder" / "rank0.json"
    liveness.record_failure("the folder is gone", env={liveness.ERROR_FILE_VAR: str(unwritable)})  # no raise
    assert not unwritable.exists()
