"""Launcher detection (hpc_rlhf.dist.launch_env): every launcher's variables, and inconsistent environments
refused in one sentence that names the variable."""

import pytest

from hpc_rlhf.dist.launch_env import BootstrapError, LaunchInfo, detect_launch, layout_from_hostnames, uses_agent_store
from tests.dist.conftest import slurm_step, torchrun


def test_slurm_one_node():
    info = detect_launch(slurm_step())
    assert info == LaunchInfo("slurm", rank=2, world_size=4, local_rank=2, local_world_size=4, node_rank=0,
                              num_nodes=1, master_addr="node1", master_port=11234, hostnames=("node1",),
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
    assert info.master_port == 10000 + 7654  # 987654 = 49 * 20000 + 7654: below the ephemeral ports (32768-)
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


def test_only_torchruns_agent_store_is_the_agents():
    assert uses_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not uses_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "False"}) and not uses_agent_store({})
