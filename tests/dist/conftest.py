"""What the dist tests share: the launch environments that srun and torchrun give a rank, as dicts."""

from __future__ import annotations


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
