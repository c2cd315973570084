import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hpc_rlhf  # noqa: E402,F401  (pins the CPU kernels before torch loads: utils/cpu_kernels.py)
import torch  # noqa: E402

torch.set_num_threads(1)

