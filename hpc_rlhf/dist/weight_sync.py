"""Actor -> rollout weight sync in flat buckets over the weight-sync group (DESIGN §4 step 8, §9).

The actor's leader (`src`) streams (name, tensor) pairs of the full model (`TrainEngine.full_state()`: one
module gathered at a time under ZeRO-3) and sends them bucket by bucket while the next module is gathered:

    header   exchange's fixed-size int64 header: tensor count n, names size, data bytes, the sender's bucket
             size, where the description is, whether it is the last bucket, dtype
    payload  the bucket's bytes (uint8 on the wire, so every dtype travels bit for bit on any backend), then its
             description: int64 words, per tensor (offset in the bucket, ndim, shape padded with zeros), then
             the n names (utf-8, newline-separated) packed into int64 words

two messages per bucket (a tensor sent straight through from its own storage has its description in a message of
its own). The last bucket's header says it is the last; only a sync whose last bucket was full before the stream
ended sends an end marker, a header with n = 0. Nothing is pickled and a receiver never posts a buffer of the
wrong size. Receivers rebuild (name, view) pairs and pass each bucket to `load_fn` (a rollout engine's `load_weights`).

Memory and overlap, on the sender: tensors of one dtype are copied into a bucket buffer of `bucket_mb`; a full
bucket goes out with an asynchronous broadcast, and while it travels the next module is gathered and packed
into a second buffer (double buffering). The buffers come from a `BucketPool` kept between syncs (no fresh
allocation per bucket or per sync): one being filled per dtype plus one in flight, so two for a model of one
dtype. A tensor at least as large as a bucket goes straight through: broadcast from its own storage, uncopied,
and waited for before the stream moves on (it may be a ZeRO-3 gathered parameter that is released as soon as
the stream moves on). So the sender never holds more than the module being streamed plus two buckets (one more
per further dtype; `SyncStats.peak_buffer_bytes` reports what the pool lent). Receivers receive into two reused
buffers as well and load one bucket while the next is arriving.

Streaming contract: every tensor the iterator yields is copied (or, when it is larger than a bucket, sent) before
the next one is requested. Names should already be Hugging Face names (`hpc_rlhf.trainers.rl_roles.hf_names`).

Hybrid placement (rollout on the actor's own ranks) uses `load_local_weights`: the same buckets, no broadcast.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from hpc_rlhf.dist.exchange import (HEADER_LEN, MAX_NDIM, ExchangeError, Kind, comm_device, make_header,
                                    message_tag, read_header)

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], object]
_META_WIDTH = 2 + MAX_NDIM
_TAG = message_tag("weights.bucket")


@dataclasses.dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    peak_buffer_bytes: int = 0  # sender: the most bucket-buffer bytes lent out at once (see the module docstring)


@dataclasses.dataclass
class Bucket:
    """A flat buffer of one dtype and where each named tensor lies in it."""
    flat: torch.Tensor
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    storage: torch.Tensor | None = None  # the pool buffer behind `flat`, handed back once the bucket is sent

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

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class BucketPool:
    """Byte buffers of `bucket_bytes` on `device`, lent to a Bucketer and taken back once a send is done.

    `acquire` prefers a free buffer; with none free it waits for the oldest send in flight when `limit` buffers
    exist already, and allocates a new one otherwise. A Bucketer opens the next bucket of a dtype before the
    full one has been handed back, so it borrows one buffer per dtype being filled plus one in flight: two for
    a model of one dtype. Buffers stay allocated between syncs; `clear` frees them.
    """

    def __init__(self, bucket_bytes: int, device: torch.device, limit: int = 2):
        self.bucket_bytes = bucket_bytes
        # room after a full bucket for its description (80 bytes and the name per tensor), so that both travel
        # in one message; a description that does not fit travels apart
        self.description_room = max(4096, bucket_bytes // 64)
        self.device = torch.device(device)
        self.limit = limit
        self.free: list[torch.Tensor] = []
        self.in_flight: collections.deque = collections.deque()  # (buffer, works) in send order
        self.allocated = 0
        self.lent = 0
        self.peak_lent_bytes = 0

    @property
    def buffer_bytes(self) -> int:
        return self.bucket_bytes + self.description_room

    def acquire(self) -> torch.Tensor:
        if not self.free and self.in_flight and self.allocated >= self.limit:
            self._finish_oldest()
        if self.free:
            buffer = self.free.pop()
        else:
            buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
            self.allocated += 1
        self.lent += 1
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent * self.buffer_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, works: list | None = None) -> None:
        """Take `buffer` back, once `works` (the sends reading it) are done."""
        if works:
            self.in_flight.append((buffer, works))
        else:
            self.lent -= 1
            self.free.append(buffer)

    def _finish_oldest(self) -> None:
        buffer, works = self.in_flight.popleft()
        for work in works:
            work.wait()
        self.lent -= 1
        self.free.append(buffer)

    def drain(self) -> None:
        """Wait for every send in flight."""
        while self.in_flight:
            self._finish_oldest()

    def clear(self) -> None:
        self.drain()
        self.free.clear()
        self.allocated = 0


class Bucketer:
    """Packs a stream of named tensors into per-dtype buckets of about `bucket_bytes` on `device`.

    `add` returns the buckets that became ready (full, or a single tensor larger than a bucket); `flush`
    returns the partly filled rest. Tensors are copied on arrival, except one larger than a bucket, which is
    handed back at once as its own bucket; either way the caller may free a tensor once the bucket(s) `add`
    returned have been used. Without a `pool` every bucket gets a fresh buffer; with one, buffers come from the
    pool and a bucket's `storage` must be given back to it (`pool.release`) once the bucket has been used.
    """

    def __init__(self, bucket_bytes: int, device: torch.device, pool: BucketPool | None = None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        if pool is not None and pool.bucket_bytes != bucket_bytes:
            raise ValueError(f"the pool's buffers hold {pool.bucket_bytes} bytes, not {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.pool = pool
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
            if self.pool is None:
                storage = None
                buffer = torch.empty(capacity, dtype=tensor.dtype, device=self.device)
            else:
                storage = self.pool.acquire()
                buffer = storage[:capacity * tensor.element_size()].view(tensor.dtype)
            self.open[tensor.dtype] = (buffer, Bucket(buffer, [], [], [], storage), 0)
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


# Buffers kept between syncs: one pool per (device, bucket size) on a sender, two receive buffers per device.
_POOLS: dict[tuple[torch.device, int], BucketPool] = {}
_RECEIVE_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


def bucket_pool(bucket_mb: float, device: torch.device) -> BucketPool:
    """The pool this process reuses for buckets of `bucket_mb` on `device`."""
    key = (torch.device(device), _bucket_bytes(bucket_mb))
    if key not in _POOLS:
        _POOLS[key] = BucketPool(key[1], key[0])
    return _POOLS[key]


def release_buffers() -> None:
    """Free every buffer kept between syncs (sender pools and receive buffers)."""
    for pool in _POOLS.values():
        pool.clear()
    _POOLS.clear()
    _RECEIVE_BUFFERS.clear()


def _count(stats: SyncStats, bucket: Bucket) -> None:
    stats.tensors += len(bucket.names)
    stats.bytes += bucket.nbytes
    stats.buckets += 1


# ------------------------------------------------------------------------------------------------- the wire
def _align(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def _description(bucket: Bucket) -> torch.Tensor:
    """int64 words: one meta row per tensor, then the names (utf-8, newline-separated, zero-padded)."""
    names = bucket.encoded_names()
    padded = torch.zeros(_align(len(names)), dtype=torch.uint8)
    padded[:len(names)] = names
    return torch.cat([bucket.meta().reshape(-1), padded.view(torch.int64)])


def _header(bucket: Bucket | None, bucket_bytes: int, inline: bool, last: bool = False) -> torch.Tensor:
    """count, names bytes, data bytes, the sender's bucket size, description inline (1) or apart (0), last bucket
    of the sync (1: no end marker follows)."""
    if bucket is None:
        return make_header(Kind.TENSOR, _TAG, torch.uint8, (0, 0, 0, 0, 0, 1))
    return make_header(Kind.TENSOR, _TAG, bucket.flat.dtype, (len(bucket.names), len(bucket.encoded_names()),
                                                              bucket.nbytes, bucket_bytes, int(inline), int(last)))


def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat.contiguous().reshape(-1).view(torch.uint8)


def _payload(bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(payload, description sent apart or None). A pool buffer has room after its data for the description,
    which then travels in the same message; a tensor sent straight through carries it apart."""
    description = _description(bucket)
    if bucket.storage is not None:
        start = _align(bucket.nbytes)
        end = start + description.numel() * 8
        if end <= bucket.storage.numel():
            bucket.storage[start:end].copy_(description.view(torch.uint8))
            return bucket.storage[:end], None
    return _as_bytes(bucket.flat), description


def send_weights(named_params: Iterable[tuple[str, torch.Tensor]], src: int,
                 group: dist.ProcessGroup | None, bucket_mb: float = 256.0) -> SyncStats:
    """Run on global rank `src` (the actor's leader) while every other rank of `group` runs receive_weights."""
    if dist.get_rank() != src:
        raise ExchangeError(f"send_weights runs on the source rank {src}, not on rank {dist.get_rank()}")
    start, stats = time.perf_counter(), SyncStats()
    device = comm_device(group)
    pool = bucket_pool(bucket_mb, device)
    pool.peak_lent_bytes = pool.lent * pool.buffer_bytes

    def send(tensor: torch.Tensor) -> object:
        return dist.broadcast(tensor.to(device), src, group=group, async_op=True)

    def post(bucket: Bucket, last: bool) -> None:
        payload, description = _payload(bucket)
        works = [send(_header(bucket, pool.bucket_bytes, description is None, last))]
        if description is not None:
            works.append(send(description))
        works.append(send(payload))
        if bucket.storage is None:  # straight through from the caller's tensor: done before it moves on
            for work in works:
                work.wait()
        else:
            pool.release(bucket.storage, works)
        _count(stats, bucket)

    try:
        bucketer = Bucketer(pool.bucket_bytes, device, pool)
        for name, tensor in named_params:
            for bucket in bucketer.add(name, tensor):
                post(bucket, last=False)
        rest = bucketer.flush()  # the partly filled buckets: the last one says so, and no end marker is needed
        for i, bucket in enumerate(rest):
            post(bucket, last=i == len(rest) - 1)
        if not rest:
            send(_header(None, pool.bucket_bytes, True)).wait()
    finally:
        pool.drain()
    stats.peak_buffer_bytes = pool.peak_lent_bytes
    stats.seconds = time.perf_counter() - start
    return stats


def _receive_buffer(device: torch.device, slot: int, nbytes: int, bucket_bytes: int) -> torch.Tensor:
    """A reused receive buffer (one of two) for a packed bucket; a fresh one for a tensor sent straight through
    (at least a bucket's size), so a large tensor does not stay allocated between syncs."""
    if nbytes >= bucket_bytes:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffers = _RECEIVE_BUFFERS.setdefault(device, [])
    while len(buffers) <= slot:
        buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
    if buffers[slot].numel() < nbytes:
        buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffers[slot][:nbytes]


def _bucket_from(raw: torch.Tensor, description: torch.Tensor, dtype: torch.dtype, count: int, names_len: int,
                 nbytes: int, what: str) -> Bucket:
    rows = description[:count * _META_WIDTH].view(count, _META_WIDTH).tolist()
    names = bytes(description[count * _META_WIDTH:].view(torch.uint8)[:names_len].numpy()).decode("utf-8")
    names = names.split("\n")
    if len(names) != count:
        raise ExchangeError(f"{what}: a bucket lists {count} tensors but {len(names)} names")
    return Bucket(raw[:nbytes].view(dtype), names, [tuple(r[2:2 + r[1]]) for r in rows], [r[0] for r in rows])


def _kept_buffer(keep: list[torch.Tensor], index: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Bucket `index`'s buffer in `keep`, the same memory at every sync unless it is too small (then a new one:
    views still pointing into the old one keep it alive until they are replaced)."""
    while len(keep) <= index:
        keep.append(torch.empty(0, dtype=torch.uint8, device=device))
    if keep[index].numel() < nbytes or keep[index].device != device:
        keep[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return keep[index][:nbytes]


def receive_weights(src: int, group: dist.ProcessGroup | None, load_fn: LoadFn,
                    keep: list[torch.Tensor] | None = None) -> SyncStats:
    """Take buckets from `src` until its last one (or end marker); `load_fn` gets each bucket's (name, view) pairs.

    Without `keep` the views point into two buffers reused for the next buckets: `load_fn` must copy what it
    keeps. With `keep` (a list the receiver holds on to, empty at first) bucket i of every sync is received into
    keep[i] and stays there: `load_fn` may keep the views as its weights, uncopied, and the next sync rewrites
    them in place (`receive_into`).
    """
    if dist.get_rank() == src:
        raise ExchangeError(f"receive_weights runs on the receiving ranks, not on the source rank {src}")
    start, stats = time.perf_counter(), SyncStats()
    device = comm_device(group)
    what = "weight sync"
    pending: tuple | None = None  # received, not yet loaded: loaded while the next bucket arrives
    slot = 0
    while True:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        dist.broadcast(header, src, group=group)
        dtype, (count, names_len, nbytes, bucket_bytes, inline, last) = read_header(header.cpu(), Kind.TENSOR, _TAG,
                                                                                    what)
        if count == 0:
            break
        words = count * _META_WIDTH + _align(names_len) // 8
        description = None
        if not inline:
            description = torch.empty(words, dtype=torch.int64, device=device)
            dist.broadcast(description, src, group=group)
        size = _align(nbytes) + 8 * words if inline else nbytes
        raw = (_kept_buffer(keep, stats.buckets, size, device) if keep is not None
               else _receive_buffer(device, slot, size, bucket_bytes))
        work = dist.broadcast(raw, src, group=group, async_op=True)
        if pending is not None:
            load_fn(_bucket_from(*pending).views())
        work.wait()
        if inline:
            description = raw[_align(nbytes):size].view(torch.int64)
        pending = (raw, description.cpu(), dtype, count, names_len, nbytes, what)
        stats.tensors += count
        stats.bytes += nbytes
        stats.buckets += 1
        slot = 1 - slot
        if last:
            break
    if pending is not None:
        load_fn(_bucket_from(*pending).views())
    stats.seconds = time.perf_counter() - start
    return stats


def receive_into(engine, src: int, group: dist.ProcessGroup | None) -> SyncStats:
    """A rollout rank's side of a sync into `engine` (None: a rank that takes part and drops the data).

    An engine with `adopt_weights` (the hf engine) takes the received buckets as its weights: its parameters
    become views of buffers it keeps (`engine.received_buffers`), which the next sync rewrites in place, so no
    receiver copies a byte out of a bucket. Every parameter must then come with every sync (a parameter left
    pointing into a rewritten buffer would hold another tensor's bytes): one that did not raises. Other engines
    (vLLM, whose own loader copies) get `load_weights`."""
    if engine is None:
        return receive_weights(src, group, lambda named: None)
    adopt = getattr(engine, "adopt_weights", None)
    if adopt is None:
        return receive_weights(src, group, engine.load_weights)
    adopted: set[int] = set()

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        adopted.update(adopt(named))

    stats = receive_weights(src, group, load, keep=engine.received_buffers)
    missing = [name for name, p in engine.model.named_parameters() if id(p) not in adopted]
    if missing:
        raise ExchangeError(f"weight sync: {len(missing)} parameters of the rollout engine were not in this sync "
                            f"(first: {missing[:3]}); an engine that keeps the received buffers needs every "
                            "parameter every time")
    return stats


def load_local_weights(named_params: Iterable[tuple[str, torch.Tensor]], load_fn: LoadFn,
                       bucket_mb: float = 256.0, device: torch.device | str | None = None) -> SyncStats:
    """Hybrid placement: the engine on this rank loads the actor's full parameters, bucket by bucket.

    Same buckets (and streaming contract) as send_weights, on `device` (default: the first tensor's device),
    from the same reused pool, without any communication.
    """
    start, stats = time.perf_counter(), SyncStats()
    named_params = iter(named_params)
    first = next(named_params, None)
    if first is None:
        return stats
    pool = bucket_pool(bucket_mb, torch.device(device) if device else first[1].device)
    pool.peak_lent_bytes = pool.lent * pool.buffer_bytes

    def everything():
        yield first
        yield from named_params

    for bucket in Bucketer(pool.bucket_bytes, pool.device, pool).buckets(everything()):
        load_fn(bucket.views())
        if bucket.storage is not None:
            pool.release(bucket.storage)
        _count(stats, bucket)
    stats.peak_buffer_bytes = pool.peak_lent_bytes
    stats.seconds = time.perf_counter() - start
    return stats
