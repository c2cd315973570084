"""The launch library: the local launcher (`local`: run a mode on the world a launcher made, or start the ranks
on this machine), the Slurm one (`slurm`: submitit submission, requeue, the per-rank runner of srun) and the dry
run (`dry_run.check_config`: would a loaded config start on an allocation).

What users run to start a job is the top-level launch/ folder (srun.sh, mpirun.sh, torchrun.sh, local.sh,
submit.py); those scripts are thin and call into this package through `python -m hpc_rlhf ...`.

Names are loaded on first use, so a training rank that only needs the local launcher does not import submitit.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run_or_spawn": "hpc_rlhf.launch.local",
    "spawn_local": "hpc_rlhf.launch.local",
    "submit": "hpc_rlhf.launch.slurm",
    "requeue_self": "hpc_rlhf.launch.slurm",
    "should_requeue": "hpc_rlhf.launch.slurm",
    "slurm_parameters": "hpc_rlhf.launch.slurm",
    "TrainingTask": "hpc_rlhf.launch.slurm",
    "SlurmLaunchError": "hpc_rlhf.launch.slurm",
    "PREEMPTED_EXIT_CODE": "hpc_rlhf.launch.slurm",
    "check_config": "hpc_rlhf.launch.dry_run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hpc_rlhf.launch' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
