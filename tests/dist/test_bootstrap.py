import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from hpc_rlhf.dist.bootstrap import (BootstrapError, LaunchInfo, detect_launch, free_port, init_distributed,
                                     layout_from_hostnames, shutdown)

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_USE_AGENT_STORE")


# ----------------------------------------------------------------------------------------- synthetic launches
def slurm_step(**extra):
    """The variables srun gives task 2 of a 4-task, 1-node step of job 1234."""
    env = dict(SLURM_JOB_ID="1234", SLURM_JOBID="1234", SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_PROCID="2",
               SLURM_NTASKS="4", SLURM_NPROCS="4", SLURM_LOCALID="2", SLURM_NODEID="0", SLURM_NODELIST="node1",
               SLURM_JOB_NODELIST="node1", SLURM_TASKS_PER_NODE="4")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def torchrun(**extra):
    env = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
               GROUP_WORLD_SIZE="2", MASTER_ADDR="head", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_slurm_one_node():
    info = detect_launch(slurm_step())
    assert info == LaunchInfo("slurm", rank=2, world_size=4, local_rank=2, local_world_size=4, node_rank=0,
                              num_nodes=1, master_addr="node1", master_port=21234, hostnames=("node1",),
                              tasks_per_node=(4,))
    assert info.ranks_per_node == 4


def test_slurm_two_nodes_port_from_job_id():
    info = detect_launch(slurm_step(SLURM_JOB_ID="987654", SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1",
                                    SLURM_NODEID="1", SLURM_NODELIST="gpu-[07-08]",
                                    SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_TASKS_PER_NODE="4(x2)"))
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("slurm", 5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes, info.hostnames) == (1, 2, ("gpu-07", "gpu-08"))
    assert info.master_addr == "gpu-07"
    assert info.master_port == 20000 + 7654  # 987654 = 49 * 20000 + 7654
    assert info.ranks_per_node == 4


def test_slurm_uneven_nodes_have_no_ranks_per_node():
    info = detect_launch(slurm_step(SLURM_PROCID="3", SLURM_LOCALID="0", SLURM_NODEID="1",
                                    SLURM_NODELIST="a,b", SLURM_TASKS_PER_NODE="3,1"))
    assert (info.local_world_size, info.node_rank, info.tasks_per_node) == (1, 1, (3, 1))
    assert info.ranks_per_node is None


def test_slurm_counts_that_only_look_uniform_are_not():
    # 2+1+3 = 6 = 3 nodes x 2 ranks on node 0: the per-node counts, not the totals, decide.
    info = detect_launch(slurm_step(SLURM_PROCID="0", SLURM_NTASKS="6", SLURM_LOCALID="0",
                                    SLURM_NODELIST="n[1-3]", SLURM_TASKS_PER_NODE="2,1,3"))
    assert info.local_world_size == 2 and info.ranks_per_node is None


def test_slurm_step_on_part_of_the_allocation_uses_the_step_nodes():
    info = detect_launch(slurm_step(SLURM_JOB_NODELIST="node[1-4]", SLURM_STEP_NODELIST="node[3-4]",
                                    SLURM_NODELIST="node[3-4]", SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2",
                                    SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NODEID="1",
                                    SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_TASKS_PER_NODE="1(x2)"))
    assert info.master_addr == "node3" and info.hostnames == ("node3", "node4") and info.world_size == 2


def test_slurm_explicit_master_wins():
    info = detect_launch(slurm_step(MASTER_ADDR="node1-ib", MASTER_PORT="29555"))
    assert (info.master_addr, info.master_port) == ("node1-ib", 29555)


@pytest.mark.parametrize("step_id", [None, "4294967291", "4294967290", "-5"])  # none, batch, interactive, old
def test_sbatch_script_outside_srun_is_a_single_process(step_id):
    # slurmstepd sets SLURM_PROCID=0 for the batch script too; only an srun step's SLURM_STEP_ID counts.
    env = dict(SLURM_JOB_ID="77", SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_NODELIST="node[1-2]", SLURM_TASKS_PER_NODE="2(x2)")
    if step_id is not None:
        env["SLURM_STEP_ID"] = step_id
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)


def test_open_mpi():
    info = detect_launch(dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
                              OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_RANK="5"))
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("mpi", 5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes) == (1, 2)
    assert info.master_addr is None and info.master_port is None


def test_mpich_pmi():
    info = detect_launch(dict(PMI_RANK="2", PMI_SIZE="3", MPI_LOCALRANKID="2", MPI_LOCALNRANKS="3"))
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("mpi", 2, 3, 2, 3)


def test_pmix_rank_with_size_from_pmi():
    info = detect_launch(dict(PMIX_RANK="1", PMIX_NAMESPACE="prterun-x-1@1", PMI_SIZE="2"))
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 1, 2)


def test_srun_with_pmix_stays_slurm():
    info = detect_launch(slurm_step(PMIX_RANK="2", PMIX_NAMESPACE="slurm.pmix.1234.0"))
    assert info.launcher == "slurm" and info.master_addr == "node1"


def test_mpirun_inside_an_allocation_is_mpi():
    # mpirun's daemons run in a 1-task srun step; its 4 ranks inherit SLURM_PROCID=0 / SLURM_NTASKS=1.
    env = slurm_step(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_NPROCS="1", SLURM_LOCALID="0",
                     SLURM_TASKS_PER_NODE="1")
    env.update(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="3",
               OMPI_COMM_WORLD_LOCAL_SIZE="4")
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 3, 4)


def test_torchrun():
    info = detect_launch(torchrun())
    assert info == LaunchInfo("torchrun", rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
                              num_nodes=2, master_addr="head", master_port=29500, hostnames=(),
                              tasks_per_node=(2, 2))
    assert info.ranks_per_node == 2


def test_torchrun_inside_srun_wins_over_slurm():
    env = slurm_step(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0",
                     SLURM_NODELIST="node[1-2]", SLURM_TASKS_PER_NODE="1(x2)")
    env.update(torchrun())
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("torchrun", 3, 4, "head")


def test_hand_made_one_rank_world():
    info = detect_launch(dict(RANK="0", WORLD_SIZE="1"))
    assert (info.launcher, info.local_rank, info.local_world_size, info.master_addr, info.master_port) == \
        ("torchrun", 0, 1, "127.0.0.1", None)


def test_no_launcher():
    info = detect_launch({"HOME": "/root", "PATH": "/usr/bin"})
    assert info == LaunchInfo("single", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)
    assert info.ranks_per_node == 1


@pytest.mark.parametrize("env, message", [
    (slurm_step(SLURM_STEP_ID="zero"), "SLURM_STEP_ID='zero' is not an integer"),
    (slurm_step(SLURM_PROCID=None), "SLURM_STEP_ID=0 says this is an srun step, but SLURM_PROCID is not set"),
    (slurm_step(SLURM_NTASKS=None, SLURM_NPROCS=None), "none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS"),
    (slurm_step(SLURM_PROCID="4"), "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    (slurm_step(SLURM_PROCID="two"), "SLURM_PROCID='two' is not an integer"),
    (slurm_step(SLURM_LOCALID="4"), "SLURM_LOCALID=4 is not below 4 (the tasks on node 0 in SLURM_TASKS_PER_NODE)"),
    (slurm_step(SLURM_LOCALID=None), "SLURM_LOCALID is not set"),
    (slurm_step(SLURM_NODELIST="node[1-", SLURM_JOB_NODELIST=None), "SLURM_NODELIST does not expand"),
    (slurm_step(SLURM_NODELIST=None, SLURM_JOB_NODELIST=None), "the master node is unknown"),
    (slurm_step(SLURM_NODEID="2", SLURM_NODELIST="a,b", SLURM_TASKS_PER_NODE="2(x2)"),
     "SLURM_NODEID=2 is not below 2 (the number of hosts in SLURM_NODELIST)"),
    (slurm_step(SLURM_NTASKS="8", SLURM_NODELIST="a,b", SLURM_TASKS_PER_NODE="3(x2)"),
     "gives 6 tasks on 2 nodes, but SLURM_NTASKS=8"),
    (slurm_step(SLURM_NODELIST="a,b", SLURM_TASKS_PER_NODE=None), "SLURM_TASKS_PER_NODE is not set"),
    (slurm_step(SLURM_JOB_ID=None, SLURM_JOBID=None), "neither MASTER_PORT nor SLURM_JOB_ID is set"),
    (slurm_step(MASTER_PORT="70000"), "MASTER_PORT='70000' is not a TCP port"),
    (torchrun(RANK=None), "WORLD_SIZE='4' is set but RANK is not"),
    (torchrun(WORLD_SIZE=None), "RANK='3' is set but WORLD_SIZE is not"),
    (torchrun(RANK="abc"), "RANK='abc' is not an integer"),
    (torchrun(RANK="4"), "RANK=4 is not below WORLD_SIZE=4"),
    (torchrun(RANK="-1"), "RANK=-1 must be at least 0"),
    (torchrun(WORLD_SIZE="0", RANK="0"), "WORLD_SIZE=0 must be at least 1"),
    (torchrun(LOCAL_RANK="2"), "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    (torchrun(GROUP_RANK="2"), "GROUP_RANK=2 is not below 2 (the number of nodes)"),
    (torchrun(LOCAL_WORLD_SIZE="8", LOCAL_RANK="0"), "LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"),
    (torchrun(MASTER_ADDR=None), "WORLD_SIZE=4 but MASTER_ADDR is not set"),
    (torchrun(MASTER_PORT="http"), "MASTER_PORT='http' is not a TCP port"),
    (torchrun(MASTER_PORT="0"), "MASTER_PORT='0' is not a TCP port"),
    (dict(OMPI_COMM_WORLD_SIZE="4"), "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not"),
    (dict(OMPI_COMM_WORLD_RANK="4", OMPI_COMM_WORLD_SIZE="4"),
     "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"),
    (dict(PMIX_RANK="3"), "PMIX_RANK='3' is set but no world size"),
    (dict(PMI_RANK="1", PMI_SIZE="x"), "PMI_SIZE='x' is not an integer"),
])
def test_inconsistent_environments_fail_with_one_sentence(env, message):
    with pytest.raises(BootstrapError) as info:
        detect_launch(env)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_layout_from_hostnames():
    hosts = ["a", "a", "b", "b", "a"]  # a rank-cyclic MPI mapping puts rank 4 back on node a
    layout = layout_from_hostnames(hosts, 4)
    assert layout == dict(node_rank=0, num_nodes=2, local_rank=2, local_world_size=3, hostnames=("a", "b"),
                          tasks_per_node=(3, 2))
    assert layout_from_hostnames(hosts, 3)["local_rank"] == 1


# ---------------------------------------------------------------------------------------------- initialising
@pytest.fixture
def clean_world():
    """Leave os.environ and torch.distributed as they were."""
    import torch.distributed as dist

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
        with pytest.raises(BootstrapError, match=f"could not form the world at 127.0.0.1:{port}.*address already"):
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
    from hpc_rlhf.dist import store_host

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
    set them); each calls init_distributed with `timeout_s` and prints what happened."""
    from tests.distributed import REPO, worker_env

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "join", str(timeout_s)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=worker_env(dict(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                                  MASTER_PORT=str(port))))
             for rank, world in ranks]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout_s + 90)  # interpreter start-up on a busy machine, then the wait
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
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
    rank0, rank2 = _join_by_hand([(0, 4), (2, 4)], timeout_s=3)
    assert rank0.returncode == 3, rank0.stdout[-3000:]
    assert "BootstrapError: rank 0 of 4 waited 3 s at the rendezvous store at 127.0.0.1:" in rank0.stdout
    assert "rank(s) 1,3 never arrived (1 of 3 did)" in rank0.stdout, rank0.stdout[-3000:]
    assert rank2.returncode != 0 and "joined" not in rank2.stdout  # its world is gone with rank 0


def test_three_torchrun_ranks_all_reduce():
    from tests.distributed import run_ranks

    proc = run_ranks(3, __file__, "allreduce", timeout=120)
    assert proc.stdout.count("allreduce ok") == 3


if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    case = sys.argv[1]
    if case == "join":
        try:
            init_distributed("gloo", timeout_s=float(sys.argv[2]))
        except BootstrapError as exc:
            print(f"BootstrapError: {exc}", flush=True)
            sys.exit(3)
        print("joined", flush=True)
        shutdown()
    elif case == "allreduce":
        info = init_distributed(expected_world_size=3, timeout_s=60)
        assert info.launcher == "torchrun" and info.world_size == 3, info
        assert info.rank == int(os.environ["RANK"]) == dist.get_rank()
        assert dist.get_backend() == "gloo"
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        assert total.item() == 6.0, total  # 1 + 2 + 3
        assert init_distributed(expected_world_size=3) is info
        shutdown()
        assert not dist.is_initialized()
        print(f"rank {info.rank}: allreduce ok", flush=True)
