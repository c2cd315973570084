"""Which GPU a rank uses and which GPUs a rollout engine's own processes see, through the devices Slurm (or the
user) made visible to the rank: the parent's `CUDA_VISIBLE_DEVICES`, by index or by UUID.

Inside a process torch numbers the visible GPUs 0..n-1. Two layouts occur on a node:
- the whole node's GPUs visible to every task (`--gpus-per-node`, the sbatch scripts' default): local rank r uses
  GPU r of the visible list;
- one GPU per task (per-task binding: `--gpus-per-task=1`, `SLURM_GPU_BIND`, `--gpu-bind=single:1`): every task
  sees one GPU and uses it, whatever its local rank.
A vLLM engine is started from its first rank with `CUDA_VISIBLE_DEVICES` set for its processes: the entries of the
rank's own list (indices or UUIDs) for the GPUs of the engine's ranks, never raw numbers, which on a shared node
without device cgroups would name another job's GPUs. An engine of several GPUs under per-task binding cannot see
its GPUs from one task and is refused with the srun option to change.

Pure functions of an environment and a device count: tested with fabricated lists (tests/dist/test_devices.py).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hpc_rlhf.dist.launch_env import BootstrapError

PER_TASK_HINT = ("per-task GPU binding (srun --gpus-per-task, --gpu-bind, SLURM_GPU_BIND) gives each task one GPU; "
                 "request the node's GPUs for every task instead (#SBATCH --gpus-per-node=N, no --gpus-per-task or "
                 "--gpu-bind)")


class DeviceError(BootstrapError):
    """The GPUs visible to a rank do not fit what the rank or its engine needs; the message says which option."""


def visible_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The parent's CUDA_VISIBLE_DEVICES as a list of entries (indices or GPU-/MIG- UUIDs); None when unset (every
    GPU of the node visible, numbered as the driver numbers them)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def rank_device(local_rank: int, local_world_size: int, device_count: int) -> int:
    """The torch device index of a rank: its local rank when the node's GPUs are visible to every task, 0 when each
    task sees one GPU of its own (per-task binding)."""
    if device_count < 1:
        raise DeviceError("no CUDA device is visible to this rank (CUDA_VISIBLE_DEVICES empty, or no GPU "
                          "requested: #SBATCH --gpus-per-node=N)")
    if device_count == 1 and local_world_size > 1:
        return 0  # per-task binding: this task's own GPU
    if local_rank >= device_count:
        raise DeviceError(f"local rank {local_rank} on this node but only {device_count} CUDA devices are visible "
                          f"to it: start at most {device_count} ranks per node, or give every task the node's GPUs "
                          f"(#SBATCH --gpus-per-node={local_world_size})")
    return local_rank


def engine_visible_devices(local_indices: Sequence[int], environ: Mapping[str, str], device_count: int) -> str:
    """CUDA_VISIBLE_DEVICES for the processes of a rollout engine whose ranks use the GPUs `local_indices` as this
    rank's torch numbers them: the matching entries of this rank's own CUDA_VISIBLE_DEVICES."""
    visible = visible_gpus(environ)
    needed = list(local_indices)
    if device_count == 1 and len(needed) > 1:
        raise DeviceError(f"a rollout engine of {len(needed)} GPUs is driven from a rank that sees one GPU: "
                          f"{PER_TASK_HINT}")
    if device_count == 1:
        needed = [0]  # per-task binding: the engine's one GPU is this task's
    for index in needed:
        if not 0 <= index < device_count:
            raise DeviceError(f"a rollout engine needs GPU {index} of this node, but this rank sees {device_count} "
                              f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    if visible is None:
        return ",".join(str(index) for index in needed)
    if len(visible) < device_count:
        raise DeviceError(f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES')!r} lists {len(visible)} "
                          f"GPUs but torch sees {device_count}")
    return ",".join(visible[index] for index in needed)
