"""Joining the world (hpc_rlhf.dist.bootstrap): one-rank worlds, errors that name address and port, MPI's
answers through mpi4py, world sizes that disagree, ranks that never arrive; detection is in test_launch_env.py."""

import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from hpc_rlhf.dist import store_host
from hpc_rlhf.dist.bootstrap import BootstrapError, free_port, init_distributed, shutdown
from tests.dist.conftest import slurm_step
from tests.distributed import REPO, rank_python, run_ranks, worker_env

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_USE_AGENT_STORE")


# ---------------------------------------------------------------------------------------------- initialising
@pytest.fixture
def clean_world():
    """No world to start with, and os.environ as it was afterwards. A world an earlier test left (the session's
    one-rank world, tests/recipes.py, which re-makes it when needed) is left first: init_distributed would describe
    it instead of making the world these tests check."""
    import torch.distributed as dist

    shutdown()
    saved = {k: os.environ.get(k) for k in LAUNCH_VARS}
    yield
    shutdown()
    assert not dist.is_initialized()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_single_process_gets_a_one_rank_gloo_world(clean_world):
    import torch
    import torch.distributed as dist

    info = init_distributed(env={}, timeout_s=30)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert info.launcher == "single" and info.master_addr == "127.0.0.1" and info.master_port > 0
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == \
        ("0", "1", str(info.master_port))
    value = torch.tensor([2.5])
    dist.all_reduce(value)
    assert value.item() == 2.5
    assert init_distributed(env={}) is info  # idempotent
    with pytest.raises(BootstrapError, match="placement needs 2 ranks but the job has 1 \\(launched by single\\)"):
        init_distributed(expected_world_size=2)
    shutdown()
    assert not dist.is_initialized()


def test_world_size_is_checked_before_any_collective(clean_world):
    import torch.distributed as dist

    with pytest.raises(BootstrapError, match="placement needs 8 ranks but the job has 6 \\(launched by slurm\\)"):
        init_distributed(expected_world_size=8, env=slurm_step(SLURM_NTASKS="6", SLURM_TASKS_PER_NODE="6"))
    assert not dist.is_initialized()


def test_backend_choice_errors(clean_world):
    import torch

    with pytest.raises(BootstrapError, match="backend 'mpi' is not one of auto, gloo, nccl"):
        init_distributed(backend="mpi", env={})
    if not torch.cuda.is_available():
        with pytest.raises(BootstrapError, match="backend 'nccl' needs CUDA"):
            init_distributed(backend="nccl", env={})


def test_port_in_use_names_address_and_port(clean_world):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with pytest.raises(BootstrapError, match=f"could not form the world at 127.0.0.1:{port}.*(?i:address already)"):
            init_distributed(env=env, timeout_s=5)


def test_unreachable_master_fails_within_the_timeout(clean_world):
    port = free_port()  # nobody listens there
    env = dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.monotonic()
    with pytest.raises(BootstrapError, match=f"rank 1 of 2 could not form the world at 127.0.0.1:{port}"):
        init_distributed(env=env, timeout_s=1)
    assert time.monotonic() - start < 20


def test_master_address_that_does_not_resolve(clean_world):
    env = dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29400")
    with pytest.raises(BootstrapError, match="master address 'no-such-host.invalid' .* does not resolve"):
        init_distributed(env=env, timeout_s=5)


class FakeComm:
    """mpi4py's COMM_WORLD for a one-rank MPI job."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, value):
        return [value]

    def bcast(self, value, root=0):
        assert root == 0
        return value


def test_mpi_launch_fills_master_and_layout_from_mpi(clean_world, monkeypatch):
    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(COMM_WORLD=FakeComm())
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    env = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="1")
    info = init_distributed(env=env, timeout_s=30)
    assert info.launcher == "mpi" and info.master_addr == socket.gethostname()
    assert info.hostnames == (socket.gethostname(),) and info.tasks_per_node == (1,)
    assert isinstance(info.master_port, int) and os.environ["MASTER_PORT"] == str(info.master_port)


def _reaped_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:  # reaped already
            return True
        time.sleep(0.05)
    return False


def test_mpi_launch_without_mpi4py_says_so_and_rank_0_ends_its_store_process(clean_world, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    started = []
    real_start = store_host.start
    monkeypatch.setattr(store_host, "start", lambda *args: started.append(real_start(*args)) or started[-1])
    env = dict(PMI_RANK="0", PMI_SIZE="2")
    with pytest.raises(BootstrapError, match="mpi4py is not installed"):
        init_distributed(env=env)
    # Rank 0 forked its store's process before asking MPI; failing, it must not leave that process serving a
    # world that will never form (the other ranks would wait for it until their timeout).
    assert len(started) == 1
    pid = started[0].pid
    try:
        assert _reaped_within(pid, 10), "rank 0's store process outlived its failed setup"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _join_by_hand(ranks: list[tuple[int, int]], timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Start one process per (RANK, WORLD_SIZE) with hand-made launch variables (as a wrong launch script would
    set them); each calls init_distributed with `timeout_s` and prints what happened.

    Each process first imports what it needs and says so, and the rendezvous starts only once all have: on a busy
    machine one interpreter's imports took longer than the others' wait (rank 0 then saw 0 ranks arrive, not 1).
    The other ranks are released first, so that they are already knocking when rank 0 opens its store."""
    port = free_port()
    envs = [worker_env(dict(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for rank, world in ranks]
    procs = [subprocess.Popen([rank_python(env), __file__, "join", str(timeout_s)], cwd=REPO, text=True, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for env in envs]
    early = [proc.stdout.readline() for proc in procs]  # "imported", or the first line of a failed start
    for _, proc in sorted(zip(ranks, procs), key=lambda item: item[0][0] == 0):
        if proc.poll() is None:
            proc.stdin.write("go\n")
            proc.stdin.flush()
    results = []
    for proc, first in zip(procs, early):
        out, _ = proc.communicate(timeout=timeout_s + 90)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, first + out))
    return results


def test_ranks_started_with_different_world_sizes_say_so():
    # A timeout long enough that a wait ending in it gives another message: these must come from the check.
    rank0, rank1 = _join_by_hand([(0, 2), (1, 3)], timeout_s=60)
    message = "rank 1 was started with WORLD_SIZE=3 but rank 0 with WORLD_SIZE=2, at the rendezvous store at 127.0.0.1:"
    for proc in (rank0, rank1):
        assert proc.returncode == 3, proc.stdout[-3000:]
        assert message in proc.stdout, proc.stdout[-3000:]
        assert "every rank of the job must be started with the same world size" in proc.stdout


def test_rank_0_names_the_ranks_that_never_arrived():
    # WORLD_SIZE=4 but only ranks 0 and 2 are started.
    rank0, rank2 = _join_by_hand([(0, 4), (2, 4)], timeout_s=10)
    assert rank0.returncode == 3, rank0.stdout[-3000:]
    assert "BootstrapError: rank 0 of 4 waited 10 s at the rendezvous store at 127.0.0.1:" in rank0.stdout
    assert "rank(s) 1,3 never arrived (1 of 3 did)" in rank0.stdout, rank0.stdout[-3000:]
    assert rank2.returncode != 0 and "joined" not in rank2.stdout  # its world is gone with rank 0


@pytest.mark.parametrize("ranks", [1, 3])
def test_torchrun_ranks_all_reduce(ranks):
    """One rank too: torchrun's agent then hosts the store all the same (the rank once tried to host it as well,
    at the agent's port, and could not bind it)."""
    proc = run_ranks(ranks, __file__, "allreduce", str(ranks), timeout=120, launcher="torchrun")
    assert proc.stdout.count("allreduce ok") == ranks


if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    case = sys.argv[1]
    if case == "join":
        print("imported", flush=True)  # _join_by_hand starts the rendezvous once every rank got here
        if sys.stdin.readline().strip() != "go":
            sys.exit(4)
        try:
            init_distributed("gloo", timeout_s=float(sys.argv[2]))
        except BootstrapError as exc:
            print(f"BootstrapError: {exc}", flush=True)
            sys.exit(3)
        print("joined", flush=True)
        shutdown()
    elif case == "allreduce":
        ranks = int(sys.argv[2])
        info = init_distributed(expected_world_size=ranks, timeout_s=60)
        assert info.launcher == "torchrun" and info.world_size == ranks, info
        assert info.rank == int(os.environ["RANK"]) == dist.get_rank()
        assert dist.get_backend() == "gloo"
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        assert total.item() == ranks * (ranks + 1) / 2, total  # 1 + 2 + ... + ranks
        assert init_distributed(expected_world_size=ranks) is info
        shutdown()
        assert not dist.is_initialized()
        print(f"rank {info.rank}: allreduce ok", flush=True)
