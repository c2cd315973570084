"""Rank 0's store process (hpc_rlhf.dist.store_host): it serves the rendezvous store, outlives rank 0 long enough
for the other ranks to read why rank 0 is gone, and then leaves on its own.

Rank 0 is played by a child process (this file's `__main__`), so that the tests can kill it; the test itself
plays rank 1, a client of the store."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from hpc_rlhf.dist import failures, liveness, store_guard, store_host, watchdog
from tests.distributed import REPO, worker_env


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


SECRET = "the job's secret"


def _raw_client(port: int):
    import torch.distributed as dist

    return dist.TCPStore(store_host.LOOPBACK, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def _client(port: int, secret: str = SECRET):
    raw = _raw_client(port)
    return store_guard.guarded(raw, secret), store_guard.guarded(raw, secret, liveness.key_prefix())


def _beat(rank: int, seq: int, state: str = liveness.RUNNING, **fields) -> str:
    beat = {"seq": seq, "role": "actor", "phase": "training", "step": 3, "host": socket.gethostname(),
            "pid": os.getpid(), "pidns": "", "state": state}
    return json.dumps({**beat, **fields})


class Rank0:
    """A child process that starts the store's process as rank 0 does, then waits to be killed."""

    def __init__(self, world_size: int, heartbeat: bool):
        self.proc = subprocess.Popen([sys.executable, __file__, str(world_size), str(int(heartbeat))], cwd=REPO,
                                     env=worker_env(), stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "serving", f"rank 0 stand-in said {line}"
        self.port, self.host_pid = int(line[1]), int(line[2])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def rank0_cleanup():
    started: list[Rank0] = []
    yield started
    for rank0 in started:
        if rank0.proc.poll() is None:
            rank0.kill()
        if failures.process_alive(rank0.host_pid):
            os.kill(rank0.host_pid, signal.SIGKILL)


def test_a_killed_rank_0_is_published_with_its_phase_and_the_store_serves_until_the_others_stop(rank0_cleanup):
    rank0 = Rank0(world_size=2, heartbeat=True)
    rank0_cleanup.append(rank0)
    store, records = _client(rank0.port)
    records.set("hb/1", _beat(1, seq=1, role="critic"))
    rank0.kill()

    _wait_for(lambda: int(records.add(liveness.FAILURE_COUNT, 0)) == 1, 5, "rank 0's failure record")
    [record] = [json.loads(line) for line in records.get(liveness.FAILURE_LOG).decode().splitlines()]
    assert (record["rank"], record["role"], record["phase"], record["step"]) == (0, "actor", "training", 3)
    assert record["primary"] and record["kind"] == "failed"
    assert liveness.format_failure(record, 1).startswith(
        f"hpc_rlhf: rank 0 (role actor) failed during training: its process (pid {rank0.proc.pid}) is gone")

    # A launcher's SIGTERM does not end it, and it serves while rank 1 still beats.
    os.kill(rank0.host_pid, signal.SIGTERM)
    for seq in range(2, 2 + int(store_host.QUIET_S) + 2):
        time.sleep(0.5)
        records.set("hb/1", _beat(1, seq=seq, role="critic"))
    assert failures.process_alive(rank0.host_pid)
    assert records.check(["hb/1"])

    records.set("hb/1", _beat(1, seq=99, state=liveness.FAILED, role="critic"))
    _wait_for(lambda: not failures.process_alive(rank0.host_pid), 5, "the store's process to leave")


def test_a_rank_that_stops_beating_does_not_keep_the_store_forever(rank0_cleanup):
    rank0 = Rank0(world_size=2, heartbeat=True)
    rank0_cleanup.append(rank0)
    _, records = _client(rank0.port)
    records.set("hb/1", _beat(1, seq=1))  # rank 1 dies too, without a word
    rank0.kill()
    started = time.monotonic()
    _wait_for(lambda: not failures.process_alive(rank0.host_pid), store_host.QUIET_S + 5,
              "the store's process to leave")
    assert time.monotonic() - started >= store_host.QUIET_S - 1


def test_a_rank_0_gone_before_its_watchdog_closes_the_store_at_once(rank0_cleanup):
    rank0 = Rank0(world_size=2, heartbeat=False)
    rank0_cleanup.append(rank0)
    store, _ = _client(rank0.port)
    rank0.kill()
    _wait_for(lambda: not failures.process_alive(rank0.host_pid), 3, "the store's process to leave")
    with pytest.raises(Exception):
        store.check(["anything"])  # so a rank still joining fails now, not at its timeout


def test_a_port_in_use_is_said():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(store_host.StoreHostError, match="(?i)address already in use"):
            store_host.start(port, 2, timeout_s=5, secret=SECRET)


@pytest.mark.parametrize("collecting", [True, False])
def test_the_fork_leaves_the_parents_collector_as_it_was(collecting):
    """The collector is off across the fork (no collection in the child's at-fork hooks) and back after it."""
    if not collecting:
        gc.disable()
    try:
        host = store_host.start(0, 1, timeout_s=5, secret=SECRET, host=store_host.LOOPBACK)
        assert gc.isenabled() == collecting
        store, _ = _client(host.port)
        host.close(store)
        _wait_for(lambda: os.waitpid(host.pid, os.WNOHANG)[0] == host.pid, 5, "the store's process to leave")
    finally:
        gc.enable()


def test_close_lets_it_leave_while_its_parent_lives():
    host = store_host.start(0, 2, timeout_s=5, secret=SECRET, host=store_host.LOOPBACK)
    store, records = _client(host.port)
    records.set("hb/0", _beat(0, seq=1, state=liveness.STOPPED))
    store.set("kept", "yes")
    assert store.get("kept") == b"yes"
    # Writers without the job's secret do not close it: the close key by its name, in the job's namespace (which
    # list_keys shows), or sealed with another secret.
    intruder = _raw_client(host.port)
    intruder.set(store_host.CLOSE_KEY, "1")
    intruder.set(f"{store_guard.namespace(SECRET)}/{store_host.CLOSE_KEY}", "1")
    _client(host.port, secret="a guess")[0].set(store_host.CLOSE_KEY, "1")
    time.sleep(10 * store_host.POLL_S)
    assert os.waitpid(host.pid, os.WNOHANG) == (0, 0)
    host.close(store)
    _wait_for(lambda: os.waitpid(host.pid, os.WNOHANG)[0] == host.pid, 5, "the store's process to leave")


if __name__ == "__main__":
    import torch.distributed as dist

    world_size, heartbeat = int(sys.argv[1]), bool(int(sys.argv[2]))
    host = store_host.start(0, world_size, timeout_s=30, secret=SECRET)
    if heartbeat:
        _client(host.port)[1].set("hb/0", _beat(0, seq=1))
    print(f"serving {host.port} {host.pid}", flush=True)
    time.sleep(600)
