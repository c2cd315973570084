"""hpc_rlhf: RLHF and alignment training for Slurm supercomputers, without Ray."""

__version__ = "0.1.0"
