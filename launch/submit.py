#!/usr/bin/env python3
"""launch/submit.py: queue an hpc_rlhf training mode on Slurm through submitit, from a login node.

Needs: a python with hpc_rlhf and submitit installed, the same one the nodes will run (on a shared file system,
or give --container); Slurm's sbatch and sacct on this machine (submitit reads the job's state from accounting);
--folder (default runs/submitit) on a file system the nodes share: submitit's pickles and logs go there.

    python launch/submit.py sft --config my_sft.yaml --nodes 2 --tasks-per-node 8 --gpus-per-node 8 \\
        --time-min 720 --partition gpu --wait -- train.lr=1e-5          # the mode's key=value after --

The same from Python (a notebook, a sweep script):

    from hpc_rlhf.launch import submit
    job = submit("sft", "my_sft.yaml", ["train.lr=1e-5"], nodes=2, tasks_per_node=8, gpus_per_node=8)
    job.results()                                      # one entry per task once the job is done

Every Slurm task runs `hpc-rlhf MODE ...` (hpc_rlhf.launch.slurm.TrainingTask). SIGUSR1 comes --signal-delay-s
before the time limit: the ranks checkpoint, rank 0 requeues the job, submitit waits for the requeued run, which
resumes from the checkpoint. The job runs in the current folder, so relative config paths work as they do here;
this script works from any folder. `--help` lists every option (`hpc-rlhf submit` is the same command).
"""

import sys

from hpc_rlhf.launch.slurm import main

if __name__ == "__main__":
    sys.exit(main(prog="launch/submit.py"))
