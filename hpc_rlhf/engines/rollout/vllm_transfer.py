"""How the weights travel from the rank that drives a vLLM engine into vLLM's workers: the bucket format both
sides share and the two transports that carry it.

The engine hands vLLM one bucket at a time through vLLM's weight-transfer API (`update_weights`, see
`vllm.VLLMRolloutEngine.load_weights`). The transport is ours, behind that API, because vLLM's own transports are
CUDA-only (`ipc`, `nccl`, ...): the receiving engines run in vLLM's worker, see `vllm_worker.py`. A bucket is packed
into one buffer, every tensor from a 64-byte boundary (`bucket_layout`, `pack_into`), and announced as plain data
(`update_info`: names, dtypes, shapes, offsets and where the buffer is); the worker reads it back as views of that
buffer (`bucket_views`).
* CPU: a memfd buffer (`SharedBuffer`) that the worker maps once through /proc/<pid>/fd; each bucket is copied in
  and announced with its layout. Measured on 38 MB of weights: 3.1-3.8x faster than sending the same bytes inline
  as `collective_rpc` arguments (211-329 MB/s against 68-87 MB/s, a loaded machine). memfd rather than /dev/shm:
  no name to leak after a kill -9 and no size cap (containers often mount a 64 MB /dev/shm).
* GPU: a CUDA buffer on the driving rank's GPU, handed over as a CUDA IPC handle (`CudaIpcBuffer`); each worker
  rebuilds it on the GPU that holds it, found by uuid (`rebuild_cuda_buffer`), and loads from there, which also
  serves tensor-parallel engines.

Both sides import this module, the driving rank and vLLM's worker; it imports no vLLM, so packing a bucket needs
none.
"""

from __future__ import annotations

import base64
import mmap
import os
import pickle
from typing import Sequence

import torch

# The names vLLM knows our transports by (`weight_transfer_config.backend`); vllm_worker registers its engines
# under them.
SHM_BACKEND, CUDA_IPC_BACKEND = "hpc_rlhf_shm", "hpc_rlhf_cuda_ipc"
_ALIGN = 64  # bytes: every tensor of a bucket starts at a multiple of this


# ------------------------------------------------------------------------------------------ bucket format
def bucket_layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed buffer (each at a multiple of 64 bytes) and the bytes needed."""
    offsets, end = [], 0
    for _, tensor in named:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return offsets, end


def update_info(named: Sequence[tuple[str, torch.Tensor]], offsets: Sequence[int], nbytes: int, **where) -> dict:
    """The `update_info` of one bucket for vLLM's `update_weights`: plain data, the buffer named by `where`."""
    return dict(where, nbytes=int(nbytes), names=[n for n, _ in named],
                dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in named],
                shapes=[list(t.shape) for _, t in named], offsets=[int(o) for o in offsets])


def pack_into(buffer: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]], offsets: Sequence[int]) -> None:
    """Copy each tensor's bytes into the uint8 `buffer` at its offset."""
    for (_, tensor), offset in zip(named, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())


def bucket_views(buffer: torch.Tensor, names: Sequence[str], dtype_names: Sequence[str],
                 shapes: Sequence[Sequence[int]], offsets: Sequence[int],
                 nbytes: int) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of a bucket in the uint8 `buffer` (the receiving side of `pack_into`)."""
    views = []
    for name, dtype_name, shape, offset in zip(names, dtype_names, shapes, offsets, strict=True):
        dtype = getattr(torch, dtype_name)
        size = dtype.itemsize
        for s in shape:
            size *= s
        if offset < 0 or offset + size > min(nbytes, buffer.numel()):
            raise ValueError(f"weight update: '{name}' lies outside the buffer ({offset} + {size} bytes of {nbytes})")
        views.append((name, buffer[offset:offset + size].view(dtype).view(tuple(shape))))
    return views


# -------------------------------------------------------------------------------- the GPU buffer, opened in a worker
def find_device_index(uuid: str, visible_uuids: Sequence[str] | None = None) -> int:
    """Local CUDA index of the GPU with this uuid, as seen by a process with its own CUDA_VISIBLE_DEVICES."""
    if visible_uuids is None:
        visible_uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if uuid not in visible_uuids:
        raise ValueError(f"the weight buffer lives on GPU {uuid}, which this vLLM worker cannot see (visible: "
                         f"{list(visible_uuids)}); the driving rank's GPU must be one of the engine's GPUs")
    return list(visible_uuids).index(uuid)


def rebuild_cuda_buffer(handle: str, device_uuid: str) -> torch.Tensor:
    """The receiving side of `CudaIpcBuffer`: its buffer, opened in this process on the GPU that holds it (torch's
    rebuild_cuda_tensor takes the device index as its 7th argument; the sender's index means nothing under this
    process's CUDA_VISIBLE_DEVICES). Unpickles: only for handles from the driving rank."""
    rebuild, args = pickle.loads(base64.b64decode(handle))
    args = list(args)
    args[6] = find_device_index(device_uuid)
    return rebuild(*args)


# ------------------------------------------------------------------------------------------ transports
class SharedBuffer:
    """CPU transport: a growable memfd buffer, filled here and mapped by vLLM's worker as /proc/<pid>/fd/<fd>."""

    backend = SHM_BACKEND

    def __init__(self):
        self.fd = os.memfd_create("hpc_rlhf_weights", os.MFD_CLOEXEC)
        self.size = 0
        self._region: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.size:
            size = max(nbytes, 2 * self.size, mmap.PAGESIZE)
            self._release()
            os.ftruncate(self.fd, size)  # grows in place: the worker maps the larger file at its next update
            self._region = mmap.mmap(self.fd, size)
            self._tensor = torch.frombuffer(self._region, dtype=torch.uint8)
            self.size = size
        return self._tensor

    def bucket(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict:
        offsets, nbytes = bucket_layout(named)
        pack_into(self._reserve(max(nbytes, 1)), named, offsets)
        return update_info(named, offsets, nbytes, path=self.path)

    def _release(self) -> None:
        self._tensor = None
        if self._region is not None:
            self._region.close()
            self._region = None

    def close(self) -> None:
        self._release()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CudaIpcBuffer:
    """GPU transport: a growable CUDA buffer on the driving rank's GPU, handed to vLLM's workers as a CUDA IPC
    handle (pickled: it holds torch's rebuild arguments, so vLLM must be allowed to unpickle it)."""

    backend = CUDA_IPC_BACKEND

    def __init__(self, device: torch.device):
        self.device = device
        self.uuid = str(torch.cuda.get_device_properties(device).uuid)
        self._tensor: torch.Tensor | None = None
        self._handle: str | None = None

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._tensor is None or self._tensor.numel() < nbytes:
            from torch.multiprocessing.reductions import reduce_tensor

            size = max(nbytes, 2 * (0 if self._tensor is None else self._tensor.numel()))
            self._tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._handle = base64.b64encode(pickle.dumps(reduce_tensor(self._tensor))).decode("ascii")
        return self._tensor

    def bucket(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict:
        offsets, nbytes = bucket_layout(named)
        pack_into(self._reserve(max(nbytes, 1)), named, offsets)
        torch.cuda.synchronize(self.device)  # the copies must land before another process reads the buffer
        return update_info(named, offsets, nbytes, handle=self._handle, device_uuid=self.uuid)

    def close(self) -> None:
        self._tensor = self._handle = None
