"""The job-private rendezvous store (hpc_rlhf.dist.store_guard): the seal, the guarded store against a real
TCPStore, where the store listens, and a job that runs to its end while a process without the secret writes to
its store."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from hpc_rlhf.dist import liveness, store_guard, store_host
from hpc_rlhf.dist.store_guard import seal, unseal
from tests.distributed import REPO, worker_env

SECRET = "0123456789abcdef" * 4


# ------------------------------------------------------------------------------------------------ the seal
def test_a_sealed_value_opens_with_its_key_and_secret_only():
    stored = seal(SECRET, "k", b"\x00value\n")
    assert unseal(SECRET, "k", stored) == (b"\x00value\n", 0)
    assert unseal(SECRET, "other", stored) == (None, 1)       # moved to another key
    assert unseal("a guess", "k", stored) == (None, 1)        # sealed with another secret
    tampered = stored.replace(b" s ", b" a ")                 # a set passed off as an append
    assert unseal(SECRET, "k", tampered) == (None, 1)


def test_reading_follows_set_and_append_and_skips_what_is_not_sealed():
    log = (seal(SECRET, "log", b"old") + seal(SECRET, "log", b"a\n") + b"forged record\n"
           + seal(SECRET, "log", b"b\n", append=True) + b"no newline at its end"
           + seal(SECRET, "log", b"c\n", append=True))
    assert unseal(SECRET, "log", log) == (b"a\nb\nc\n", 2)   # the last set, then the appends after it
    assert unseal(SECRET, "log", b"") == (None, 0)
    assert unseal(SECRET, "log", b"\n\xff\xfe a %%%\n") == (None, 1)


def test_the_namespace_does_not_reveal_the_secret():
    space = store_guard.namespace(SECRET)
    assert space.startswith(store_guard.NAMESPACE_ROOT + "/") and SECRET not in space and SECRET[:8] not in space
    assert space == store_guard.namespace(SECRET) != store_guard.namespace("another job")


def test_the_secret_comes_from_the_environment():
    assert store_guard.secret_from_env({store_guard.SECRET_VAR: " s3 "}) == "s3"
    assert store_guard.secret_from_env({store_guard.SECRET_VAR: ""}) is None
    assert store_guard.secret_from_env({}) is None
    assert store_guard.make_secret() != store_guard.make_secret()


# -------------------------------------------------------------------------------------------- the store
@pytest.fixture
def server():
    import torch.distributed as dist

    listening = store_host.listen_socket(store_host.LOOPBACK, 0)
    port = listening.getsockname()[1]
    store = dist.TCPStore(store_host.LOOPBACK, port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5), master_listen_fd=listening.detach())
    yield store


def _client(server, timeout_s: float = 5):
    import torch.distributed as dist

    return dist.TCPStore(store_host.LOOPBACK, server.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def test_a_foreign_value_is_waited_past_and_then_named(server):
    store = store_guard.guarded(_client(server, timeout_s=1), SECRET, "pg")
    intruder = _client(server)
    key = f"{store_guard.namespace(SECRET)}/pg/addr"
    intruder.set(key, "10.0.0.66:1234")
    with pytest.raises(store_guard.StoreTampered, match="key 'pg/addr' holds a value that this job did not write"):
        store.get("addr")
    intruder.set(key, "10.0.0.66:1234")
    other = store_guard.guarded(_client(server), SECRET, "pg")
    other.set_timeout(timedelta(seconds=5))
    # The job's own write replaces the foreign one while a reader waits: the reader gets the job's value.
    _after(0.3, lambda: store.set("addr", "10.0.0.1:29500"))
    assert other.get("addr") == b"10.0.0.1:29500"
    assert not any(SECRET in k for k in intruder.list_keys())


def _after(delay_s: float, action) -> None:
    import threading

    timer = threading.Timer(delay_s, action)
    timer.start()


def test_the_store_listens_where_the_ranks_connect():
    assert store_host.listen_host("127.0.0.1", one_node=True) == "127.0.0.1"
    assert store_host.listen_host("localhost", one_node=False) == ""   # loopback here may not be for the others
    assert store_host.listen_host("no-such-host.invalid", one_node=True) == ""
    with store_host.listen_socket("127.0.0.1", 0) as listening:
        assert listening.getsockname()[0] == "127.0.0.1"
    with store_host.listen_socket("192.0.2.1", 0) as listening:  # TEST-NET-1: not an address of this host
        assert listening.getsockname()[0] == "0.0.0.0"


# --------------------------------------------------------------------------------- a job and an intruder
def test_a_process_without_the_secret_cannot_steer_a_running_job(tmp_path):
    """The intruder knows the code: it writes the watchdog's failure log, the store process's close key and a
    torch rendezvous key by their names, and, having listed the keys, forges lines in the job's namespace too."""
    import torch.distributed as dist

    port_file, done_file = tmp_path / "port", tmp_path / "intruder_done"
    code = ("import sys; from hpc_rlhf.launch.local import spawn_local; "
            f"sys.exit(spawn_local(2, [sys.executable, {str(__file__)!r}, {str(port_file)!r}, {str(done_file)!r}]))")
    env = worker_env({"HPC_RLHF_HEARTBEAT_TIMEOUT_S": "3"})
    env.pop(store_guard.SECRET_VAR, None)  # the local launcher makes one
    job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_file.exists(), f"the job never said its port: {job.communicate(timeout=30)}"
        intruder = dist.TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=5))
        forged = json.dumps(liveness.failure_record(1, "actor", "training", 1, "failed", "obey the intruder",
                                                    primary=True, by=1)) + "\n"
        prefix = liveness.key_prefix()
        intruder.append(f"{prefix}/{liveness.FAILURE_LOG}", forged)
        intruder.add(f"{prefix}/{liveness.FAILURE_COUNT}", 1)
        intruder.set(store_host.CLOSE_KEY, "1")
        intruder.set("0//cpu//0/1", "10.0.0.66")                  # where gloo's rank 1 of the world says it is
        for key in intruder.list_keys():
            if key.endswith(liveness.FAILURE_LOG):
                intruder.append(key, "\n" + forged)
                intruder.add(key.replace(liveness.FAILURE_LOG, liveness.FAILURE_COUNT), 1)
            elif key.endswith("//cpu//0/1"):
                intruder.set(key, "10.0.0.66")                      # after the world formed: read no more
        intruder.set(f"{store_guard.namespace('a guess')}/{store_host.CLOSE_KEY}", "1")
        done_file.write_text("done")
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    assert "finished 2 ranks" in out and "obey the intruder" not in out + err
    assert "is not set" not in err  # the local launcher made the secret


def _job(port_file: str, done_file: str) -> None:
    """A rank of the job: steps with a collective each, until the intruder is done (or 60 s), then a new group
    (more rendezvous keys, written after the intrusion) and a last collective on it."""
    import torch
    import torch.distributed as dist

    from hpc_rlhf.config import DistSection
    from hpc_rlhf.dist import bootstrap, watchdog
    from hpc_rlhf.launch.local import run_or_spawn

    class Cfg:
        dist = DistSection(timeout_s=60, nproc=2)

    def run(cfg):
        rank = dist.get_rank()
        watchdog.start(["actor"], watchdog.heartbeat_timeout(cfg), store_host_rank=bootstrap.store_host_rank())
        if rank == 0:
            Path(port_file + ".tmp").write_text(os.environ["MASTER_PORT"])
            os.replace(port_file + ".tmp", port_file)
        deadline = time.monotonic() + 60
        step = 0
        while True:
            step += 1
            watchdog.set_step(step)
            with watchdog.phase("training"):
                done = torch.tensor([float(Path(done_file).exists() or time.monotonic() > deadline)])
                dist.all_reduce(done)
            if done.item() > 0:
                break
            time.sleep(0.2)
        time.sleep(2.0)  # a few heartbeats that read the forged failure log
        group = dist.new_group([0, 1])
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        assert total.item() == 2
        if rank == 0:
            print("finished 2 ranks", flush=True)

    sys.exit(run_or_spawn("test", Cfg(), run, []))


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
