"""hpc_rlhf: RLHF and alignment training for Slurm supercomputers, without Ray."""

from hpc_rlhf.utils.cpu_kernels import pin_cpu_kernels

__version__ = "0.1.0"

# Before anything imports torch: the same CPU kernels on every machine, so seeded CPU runs repeat bit for bit
# across machines (utils/cpu_kernels.py says what was measured).
pin_cpu_kernels()
