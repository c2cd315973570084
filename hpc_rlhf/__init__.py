"""hpc_rlhf: RLHF and alignment training for Slurm supercomputers, without Ray."""

from hpc_rlhf.utils.console import quiet_torch_warnings
from hpc_rlhf.utils.cpu_kernels import pin_cpu_kernels

__version__ = "0.1.0"

# Before anything imports torch: the same CPU kernels on every machine, so seeded CPU runs repeat bit for bit
# across machines (utils/cpu_kernels.py says what was measured); and torch's C++ warnings, which come with stack
# dumps, kept quiet unless HPC_RLHF_DEBUG=1 (utils/console.py).
pin_cpu_kernels()
quiet_torch_warnings()
