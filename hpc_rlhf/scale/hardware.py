"""Hardware profiles for the step-time model (step_time.py): presets for H100, H200 and A100 nodes, and a `cpu`
profile measured on the machine at hand by `hpc-rlhf plan --calibrate` (calibrate.py). Pure Python.

Per device (one rank): peak dense bf16 FLOP/s, HBM bandwidth, the bandwidth of one GPU's link to the others of its
node (NVLink, one direction) and to other nodes (its InfiniBand adapter, one direction), and a message latency.
The vendor figures and their sources are in docs/planner.md (SOURCES below names them too); the
efficiencies (how much of a peak a phase reaches) are this project's stated assumptions for GPUs, and measured on
this machine for `cpu`.

The `cpu` profile lives in a JSON file: `$HPC_RLHF_CPU_PROFILE` when set, else
`$XDG_CACHE_HOME/hpc_rlhf/cpu_profile.json` (`~/.cache/hpc_rlhf/cpu_profile.json` without XDG_CACHE_HOME):
`calibrate` writes it, `load("cpu")` reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

GB = 1e9


class ProfileError(ValueError):
    """An unknown profile, or a `cpu` profile that was never measured or cannot be read."""


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s of one device (fp32 on a CPU core)
    memory_bytes_per_s: float  # HBM (CPU: main memory as one thread sees it)
    intra_node_bytes_per_s: float  # one device to another of its node, one direction
    inter_node_bytes_per_s: float  # one device to another node, one direction (its share of the node's adapters)
    latency_s: float  # one message between two ranks, small
    memory_gb: float
    # how much of a peak each phase reaches: assumptions for GPUs, measured for cpu
    mfu_train: float  # forward + backward + optimizer
    mfu_score: float  # forward only, long sequences
    mfu_decode: float  # a decode step's matrix products (batch x hidden), when they outweigh the weight reads
    memory_efficiency: float  # share of memory_bytes_per_s a decode step's weight and KV reads reach
    decode_step_overhead_s: float  # fixed cost of one decode step (scheduling, kernel launches, sampling)
    pass_overhead_s: float  # fixed cost of one forward pass of a micro-batch (and as much for its backward)
    optimizer_step_overhead_s: float  # fixed cost of one optimizer step (DeepSpeed's engine.step)
    cores: int | None = None  # CPU: cores the ranks share (a rank is one thread); None: one device per rank
    bytes_per_param: int = 2  # bf16 on GPU, fp32 on CPU
    source: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Stated assumptions for the GPU presets (not measured here; docs/planner.md says why these values):
# training MFU 40% (DeepSpeed ZeRO-3 runs of 7-70B models report 30-50%), forward-only scoring 50%, decode reaching
# 70% of HBM bandwidth, 3 ms fixed per decode step (vLLM with CUDA graphs), 10 ms per pass and 50 ms per optimizer
# step of framework overhead.
_GPU_ASSUMPTIONS = dict(mfu_train=0.40, mfu_score=0.50, mfu_decode=0.50, memory_efficiency=0.70,
                        decode_step_overhead_s=0.003, pass_overhead_s=0.010, optimizer_step_overhead_s=0.050,
                        latency_s=20e-6)

SOURCES = {
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 989 TFLOPS dense BF16 (1,979 with sparsity), 80 GB "
            "HBM3 at 3.35 TB/s, NVLink 900 GB/s); NVIDIA DGX H100 user guide (8 x ConnectX-7 400 Gb/s per node: "
            "50 GB/s per GPU)",
    "h200": "NVIDIA H200 Tensor Core GPU product page/datasheet (H200 SXM: 989 TFLOPS dense BF16, 141 GB HBM3e at "
            "4.8 TB/s, NVLink 900 GB/s); HGX H200 nodes with one 400 Gb/s ConnectX-7 per GPU",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (A100 SXM4 80GB: 312 TFLOPS BF16, HBM2e 2,039 GB/s, NVLink "
            "600 GB/s); NVIDIA DGX A100 user guide (8 x ConnectX-6 200 Gb/s HDR per node: 25 GB/s per GPU)",
}

PRESETS = {
    # NVLink is quoted both ways: 900 GB/s is 450 GB/s in each direction.
    "h100": Profile("h100", peak_flops=989e12, memory_bytes_per_s=3.35e12, intra_node_bytes_per_s=450e9,
                    inter_node_bytes_per_s=50e9, memory_gb=80, source=SOURCES["h100"], **_GPU_ASSUMPTIONS),
    "h200": Profile("h200", peak_flops=989e12, memory_bytes_per_s=4.8e12, intra_node_bytes_per_s=450e9,
                    inter_node_bytes_per_s=50e9, memory_gb=141, source=SOURCES["h200"], **_GPU_ASSUMPTIONS),
    "a100": Profile("a100", peak_flops=312e12, memory_bytes_per_s=2.039e12, intra_node_bytes_per_s=300e9,
                    inter_node_bytes_per_s=25e9, memory_gb=80, source=SOURCES["a100"], **_GPU_ASSUMPTIONS),
}
NAMES = (*PRESETS, "cpu")


def cpu_profile_path() -> Path:
    """Where the measured `cpu` profile lives (see the module docstring)."""
    if os.environ.get("HPC_RLHF_CPU_PROFILE"):
        return Path(os.environ["HPC_RLHF_CPU_PROFILE"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hpc_rlhf" / "cpu_profile.json"


def load(name: str) -> Profile:
    """A preset, or the `cpu` profile measured by `hpc-rlhf plan --calibrate`."""
    key = name.lower()
    if key in PRESETS:
        return PRESETS[key]
    if key != "cpu":
        raise ProfileError(f"unknown hardware profile '{name}'; profiles: {', '.join(NAMES)}")
    path = cpu_profile_path()
    if not path.is_file():
        raise ProfileError(f"no measured cpu profile at {path}: run `hpc-rlhf plan --calibrate` on this machine "
                           f"first (or set HPC_RLHF_CPU_PROFILE)")
    try:
        fields = json.loads(path.read_text())["profile"]
        return Profile(**fields)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"{path} is not a cpu profile written by `hpc-rlhf plan --calibrate` ({exc}); "
                           f"calibrate again") from None


def save_cpu_profile(profile: Profile, measured: dict, path: Path | None = None) -> Path:
    """Write the measured `cpu` profile (and the raw measurements it came from) where `load` finds it."""
    path = path or cpu_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"profile": profile.to_dict(), "measured": measured}, indent=1))
    tmp.replace(path)
    return path
