"""Actor -> rollout weight sync in flat buckets over the weight-sync group (DESIGN §4 step 8, §9).

The actor's leader (`src`) streams (name, tensor) pairs of the full model; tensors of one dtype are copied
into a flat buffer of about `bucket_mb`, and each full buffer goes out as three messages:

    meta    int64 [n, 2 + MAX_NDIM]: per tensor (offset in the buffer, ndim, shape padded with zeros)
    names   uint8: the n names, utf-8, joined by newlines
    bucket  the flat buffer, in the tensors' dtype (bit for bit; see `exchange` for dtypes gloo lacks)

followed at the end by a meta message with no rows. Every message carries `exchange`'s fixed-size header, so
nothing is pickled and a receiver never posts a buffer of the wrong size. Receivers rebuild (name, view)
pairs and pass each bucket to `load_fn` (a rollout engine's `load_weights`), which copies them in place.

Streaming contract: every tensor the iterator yields is copied (or, when it is larger than a bucket, sent on
its own) before the next one is requested. Under ZeRO-3 the caller can therefore gather one module at a time
and release it as soon as the iterator moves on. Names should already be Hugging Face names
(`hpc_rlhf.engines.rollout.base.hf_named_tensors`).

Hybrid placement (rollout on the actor's own ranks) uses `load_local_weights`: the same buckets, no broadcast.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from hpc_rlhf.dist.exchange import MAX_NDIM, ExchangeError, broadcast_tensor, comm_device

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], object]
_META_WIDTH = 2 + MAX_NDIM


@dataclasses.dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class Bucket:
    """A flat buffer of one dtype and where each named tensor lies in it."""
    flat: torch.Tensor
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]

    def views(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, shape, offset in zip(self.names, self.shapes, self.offsets):
            numel = 1
            for s in shape:
                numel *= s
            out.append((name, self.flat[offset:offset + numel].view(shape)))
        return out

    def meta(self) -> torch.Tensor:
        rows = torch.zeros(len(self.names), _META_WIDTH, dtype=torch.int64)
        for i, (shape, offset) in enumerate(zip(self.shapes, self.offsets)):
            rows[i, 0], rows[i, 1] = offset, len(shape)
            rows[i, 2:2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        return rows

    def encoded_names(self) -> torch.Tensor:
        return torch.frombuffer(bytearray("\n".join(self.names).encode("utf-8")), dtype=torch.uint8)


class Bucketer:
    """Packs a stream of named tensors into per-dtype buckets of about `bucket_bytes` on `device`.

    `add` returns the buckets that became ready (full, or a single tensor larger than a bucket); `flush`
    returns the partly filled rest. Tensors are copied on arrival, except one larger than a bucket, which is
    handed back at once as its own bucket; either way the caller may free a tensor once the bucket(s) `add`
    returned have been used.
    """

    def __init__(self, bucket_bytes: int, device: torch.device):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.open: dict[torch.dtype, tuple[torch.Tensor, Bucket, int]] = {}  # dtype -> (buffer, bucket, fill)

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        if not name or "\n" in name:
            raise ExchangeError(f"weight sync: parameter name {name!r} is empty or contains a newline")
        if tensor.dim() > MAX_NDIM:
            raise ExchangeError(f"weight sync: '{name}' has {tensor.dim()} dimensions, more than {MAX_NDIM}")
        tensor = tensor.detach()
        ready = []
        if tensor.numel() * tensor.element_size() >= self.bucket_bytes:
            # Larger than a bucket: it travels alone and uncopied (when contiguous and already on the device),
            # which is safe because the bucket is used before the caller's iterator moves on.
            flat = tensor.reshape(-1).to(self.device)
            return [Bucket(flat, [name], [tuple(tensor.shape)], [0])]
        capacity = self.bucket_bytes // tensor.element_size()
        if tensor.dtype in self.open and self.open[tensor.dtype][2] + tensor.numel() > capacity:
            ready.append(self._close(tensor.dtype))
        if tensor.dtype not in self.open:
            buffer = torch.empty(capacity, dtype=tensor.dtype, device=self.device)
            self.open[tensor.dtype] = (buffer, Bucket(buffer, [], [], []), 0)
        buffer, bucket, fill = self.open[tensor.dtype]
        buffer[fill:fill + tensor.numel()].copy_(tensor.reshape(-1))
        bucket.names.append(name)
        bucket.shapes.append(tuple(tensor.shape))
        bucket.offsets.append(fill)
        self.open[tensor.dtype] = (buffer, bucket, fill + tensor.numel())
        return ready

    def _close(self, dtype: torch.dtype) -> Bucket:
        buffer, bucket, fill = self.open.pop(dtype)
        bucket.flat = buffer[:fill]
        return bucket

    def flush(self) -> list[Bucket]:
        return [self._close(dtype) for dtype in list(self.open)]

    def buckets(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        for name, tensor in named:
            yield from self.add(name, tensor)
        yield from self.flush()


def _bucket_bytes(bucket_mb: float) -> int:
    if bucket_mb <= 0:
        raise ExchangeError(f"weight sync: bucket_mb must be positive, got {bucket_mb}")
    return max(1, int(bucket_mb * 2**20))


def _count(stats: SyncStats, bucket: Bucket) -> None:
    stats.tensors += len(bucket.names)
    stats.bytes += bucket.flat.numel() * bucket.flat.element_size()
    stats.buckets += 1


def send_weights(named_params: Iterable[tuple[str, torch.Tensor]], src: int,
                 group: dist.ProcessGroup | None, bucket_mb: float = 256.0) -> SyncStats:
    """Run on global rank `src` (the actor's leader) while every other rank of `group` runs receive_weights."""
    if dist.get_rank() != src:
        raise ExchangeError(f"send_weights runs on the source rank {src}, not on rank {dist.get_rank()}")
    start, stats = time.perf_counter(), SyncStats()
    for bucket in Bucketer(_bucket_bytes(bucket_mb), comm_device(group)).buckets(named_params):
        broadcast_tensor(bucket.meta(), src, group, tag="weights.meta")
        broadcast_tensor(bucket.encoded_names(), src, group, tag="weights.names")
        broadcast_tensor(bucket.flat, src, group, tag="weights.bucket")
        _count(stats, bucket)
    broadcast_tensor(torch.zeros(0, _META_WIDTH, dtype=torch.int64), src, group, tag="weights.meta")
    stats.seconds = time.perf_counter() - start
    return stats


def receive_weights(src: int, group: dist.ProcessGroup | None, load_fn: LoadFn) -> SyncStats:
    """Take buckets from `src` until its end marker; `load_fn` gets each bucket's (name, view) pairs.

    The views point into a buffer that is dropped afterwards: `load_fn` must copy what it keeps.
    """
    if dist.get_rank() == src:
        raise ExchangeError(f"receive_weights runs on the receiving ranks, not on the source rank {src}")
    start, stats = time.perf_counter(), SyncStats()
    while True:
        meta = broadcast_tensor(None, src, group, tag="weights.meta").cpu()
        if meta.shape[0] == 0:
            break
        names = bytes(broadcast_tensor(None, src, group, tag="weights.names").cpu().numpy()).decode("utf-8")
        flat = broadcast_tensor(None, src, group, tag="weights.bucket")
        names = names.split("\n")
        if len(names) != meta.shape[0]:
            raise ExchangeError(f"weight sync: a bucket lists {meta.shape[0]} tensors but {len(names)} names")
        rows = meta.tolist()
        bucket = Bucket(flat, names, [tuple(r[2:2 + r[1]]) for r in rows], [r[0] for r in rows])
        load_fn(bucket.views())
        _count(stats, bucket)
    stats.seconds = time.perf_counter() - start
    return stats


def load_local_weights(named_params: Iterable[tuple[str, torch.Tensor]], load_fn: LoadFn,
                       bucket_mb: float = 256.0, device: torch.device | str | None = None) -> SyncStats:
    """Hybrid placement: the engine on this rank loads the actor's full parameters, bucket by bucket.

    Same buckets (and streaming contract) as send_weights, on `device` (default: the first tensor's device),
    without any communication.
    """
    start, stats = time.perf_counter(), SyncStats()
    named_params = iter(named_params)
    first = next(named_params, None)
    if first is None:
        return stats
    bucketer = Bucketer(_bucket_bytes(bucket_mb), torch.device(device) if device else first[1].device)

    def everything():
        yield first
        yield from named_params

    for bucket in bucketer.buckets(everything()):
        load_fn(bucket.views())
        _count(stats, bucket)
    stats.seconds = time.perf_counter() - start
    return stats
