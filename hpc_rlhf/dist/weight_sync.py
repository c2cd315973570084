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

The same layout again (`reuse_layout=True`, what the RL trainer passes: it streams the same model every step):
after a first sync as above, which both sides remember (sender: per group, source and bucket size; receivers:
per group and source, by the layout's fingerprint), a sync is one header naming that layout, then the payloads
alone, in the same order: no header, description or end marker per bucket. Every message costs a round of
wake-ups on every rank besides its bytes (on 2 CPU cores, roughly what copying 4 MB costs), so this is what lets
large tensors go straight through uncopied. The sender checks every bucket against the remembered layout and
raises if the stream differs (the receivers, waiting for the promised payloads, are then ended by the watchdog).

Memory and overlap, on the sender: tensors of one dtype are copied into a bucket buffer of `bucket_mb`; a full
bucket goes out with an asynchronous broadcast, and while it travels the next module is gathered and packed
into a second buffer (double buffering). The buffers come from a `BucketPool` kept between syncs (no fresh
allocation per bucket or per sync): one being filled per dtype plus one in flight, so two for a model of one
dtype. A tensor of at least a bucket's size, or of `STRAIGHT_THROUGH_MB`, goes straight through: broadcast
from its own storage, uncopied, and waited for before the stream moves on (it may be a ZeRO-3 gathered parameter
that is released as soon as the stream moves on). So the sender never holds more than the module being streamed
plus two buckets (one more per further dtype; `SyncStats.peak_buffer_bytes` reports what the pool lent).
Receivers receive into two reused buffers as well and load one bucket while the next is arriving.

Streaming contract: every tensor the iterator yields is copied (or, when it is larger than a bucket, sent) before
the next one is requested. Names should already be Hugging Face names
(`hpc_rlhf.engines.rollout.base.hf_named_tensors`), or for a LoRA actor's adapter-only sync the names of PEFT's
adapter file (`hpc_rlhf.models.lora.adapter_tensors`): the protocol carries any named tensors.

Hybrid placement (rollout on the actor's own ranks) uses `load_local_weights`: the same buckets, no broadcast.

Length: over 500 lines because it is one protocol, the sender's framing and the receiver's reading of it side by
side (a change on one side is a change on the other), with the bucket buffers both sides reuse.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from hpc_rlhf.dist import bucket_plan
from hpc_rlhf.dist.exchange import (DTYPES, HEADER_LEN, MAX_NDIM, ExchangeError, Kind, comm_device,
                                    make_header, message_tag, read_header)

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], object]
_META_WIDTH = 2 + MAX_NDIM
_TAG = message_tag("weights.bucket")
_LAYOUT_TAG = message_tag("weights.layout")
STRAIGHT_THROUGH_MB = bucket_plan.STRAIGHT_THROUGH_MB  # the rule, as data: dist/bucket_plan.py


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

    `add` returns the buckets that became ready (full, or a single tensor of a bucket's size or of
    STRAIGHT_THROUGH_MB); `flush` returns the partly filled rest. Tensors are copied on arrival, except such a
    large one, which is handed back at once as its own bucket; either way the caller may free a tensor once the
    bucket(s) `add` returned have been used. Without a `pool` every bucket gets a fresh buffer; with one, buffers
    come from the pool and a bucket's `storage` must be given back to it (`pool.release`) once the bucket has been
    used.
    """

    def __init__(self, bucket_bytes: int, device: torch.device, pool: BucketPool | None = None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        if pool is not None and pool.bucket_bytes != bucket_bytes:
            raise ValueError(f"the pool's buffers hold {pool.bucket_bytes} bytes, not {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.straight_through_bytes = bucket_plan.straight_through_bytes(bucket_bytes)
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
        if tensor.numel() * tensor.element_size() >= self.straight_through_bytes:
            # A bucket's size or STRAIGHT_THROUGH_MB: it travels alone and uncopied (when contiguous and already
            # on the device), which is safe because the bucket is used before the caller's iterator moves on.
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
# Layouts of earlier syncs (reuse_layout): the sender's by (group, src, bucket bytes), the receivers' by
# (group, src) and fingerprint. The group object itself is the key: a world set up again gets new groups.
_SENT_LAYOUTS: dict[tuple, list[tuple]] = {}
_RECEIVED_LAYOUTS: dict[tuple, dict[int, list[tuple]]] = {}


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
    _SENT_LAYOUTS.clear()
    _RECEIVED_LAYOUTS.clear()


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


# A message's layout: (dtype, data bytes, names, shapes, offsets); both sides build it the same way.
def _spec(bucket: Bucket) -> tuple:
    return (str(bucket.flat.dtype), bucket.nbytes, tuple(bucket.names), tuple(bucket.shapes), tuple(bucket.offsets))


def _fingerprint(layout: list[tuple]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(layout).encode("utf-8"), digest_size=7).digest(), "little")


def _group_key(group: dist.ProcessGroup | None) -> object:
    return group if group is not None else dist.group.WORLD


def _differs(expected: tuple | None, got: tuple, index: int) -> ExchangeError:
    said = "nothing more" if expected is None else f"{list(expected[2])[:3]} ({expected[0]}, {expected[1]} bytes)"
    return ExchangeError(f"weight sync: message {index} of this sync holds {list(got[2])[:3]} ({got[0]}, {got[1]} "
                         f"bytes) where the layout of the first sync had {said}; reuse_layout needs the same "
                         "tensors in the same order at every sync")


def send_weights(named_params: Iterable[tuple[str, torch.Tensor]], src: int,
                 group: dist.ProcessGroup | None, bucket_mb: float = 256.0, reuse_layout: bool = False,
                 device: torch.device | None = None) -> SyncStats:
    """Run on global rank `src` (the actor's leader) while every other rank of `group` runs receive_weights.

    reuse_layout: the stream has the same names, shapes and dtypes as at this sender's first such sync on this
    group with this bucket size, so the payloads go without their headers (see the module docstring).
    device: where buckets are packed and sent from; default the group's communication device (`hpc-rlhf
    simulate` streams a model on the meta device through the meta device: the same buckets, no bytes)."""
    if dist.get_rank() != src:
        raise ExchangeError(f"send_weights runs on the source rank {src}, not on rank {dist.get_rank()}")
    start, stats = time.perf_counter(), SyncStats()
    device = torch.device(device) if device is not None else comm_device(group)
    pool = bucket_pool(bucket_mb, device)
    pool.peak_lent_bytes = pool.lent * pool.buffer_bytes
    key = (_group_key(group), src, pool.bucket_bytes)
    known = _SENT_LAYOUTS.get(key) if reuse_layout else None
    layout: list[tuple] = []

    def send(tensor: torch.Tensor) -> object:
        return dist.broadcast(tensor.to(device), src, group=group, async_op=True)

    def post(bucket: Bucket, last: bool) -> None:
        spec = _spec(bucket)
        if known is None:
            payload, description = _payload(bucket)
            works = [send(_header(bucket, pool.bucket_bytes, description is None, last))]
            if description is not None:
                works.append(send(description))
            works.append(send(payload))
        else:
            if len(layout) >= len(known) or known[len(layout)] != spec:
                raise _differs(known[len(layout)] if len(layout) < len(known) else None, spec, len(layout))
            works = [send(_as_bytes(bucket.flat))]
        layout.append(spec)
        if bucket.storage is None:  # straight through from the caller's tensor: done before it moves on
            for work in works:
                work.wait()
        else:
            pool.release(bucket.storage, works)
        _count(stats, bucket)

    try:
        if known is not None:
            send(make_header(Kind.TENSOR, _LAYOUT_TAG, torch.uint8, (_fingerprint(known), len(known))))
        bucketer = Bucketer(pool.bucket_bytes, device, pool)
        for name, tensor in named_params:
            for bucket in bucketer.add(name, tensor):
                post(bucket, last=False)
        rest = bucketer.flush()  # the partly filled buckets: the last one says so, and no end marker is needed
        for i, bucket in enumerate(rest):
            post(bucket, last=i == len(rest) - 1)
        if known is None and not rest:
            send(_header(None, pool.bucket_bytes, True)).wait()
        if known is not None and len(layout) != len(known):
            raise ExchangeError(f"weight sync: this sync had {len(layout)} messages where the layout of the first "
                                f"sync had {len(known)}; reuse_layout needs the same tensors at every sync")
    finally:
        pool.drain()
    if reuse_layout and known is None:
        _SENT_LAYOUTS[key] = layout
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


def _kept_buffer(keep: list[torch.Tensor], index: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Bucket `index`'s buffer in `keep`, the same memory at every sync unless it is too small (then a new one:
    views still pointing into the old one keep it alive until they are replaced)."""
    while len(keep) <= index:
        keep.append(torch.empty(0, dtype=torch.uint8, device=device))
    if keep[index].numel() < nbytes or keep[index].device != device:
        keep[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return keep[index][:nbytes]


@dataclasses.dataclass
class _Incoming:
    """A message a receiver is about to take: its size and, once known, its layout (`spec`, see _spec); the
    layout of a bucket whose description travels inline is read from the message after it arrives."""
    nbytes: int  # the data
    size: int  # the whole message: the data and an inline description
    bucket_bytes: int  # the sender's bucket size: a message of at least that is one tensor sent straight through
    spec: tuple | None = None
    inline: tuple = ()  # (dtype name, count, names length) while spec is None


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
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    header = header.cpu()
    layouts = _RECEIVED_LAYOUTS.setdefault((_group_key(group), src), {})
    reused = int(header[2]) == _LAYOUT_TAG
    if reused:  # the sender's reuse_layout: the payloads of a layout received before, nothing else
        _, (fingerprint, count) = read_header(header, Kind.TENSOR, _LAYOUT_TAG, what)
        if fingerprint not in layouts or len(layouts[fingerprint][1]) != count:
            raise ExchangeError(f"{what}: the sender reuses the layout of an earlier sync that this rank did not "
                                "receive (a receiver that joined later, or buffers released on one side only)")
        bucket_bytes, specs = layouts[fingerprint]
        messages = (_Incoming(spec[1], spec[1], bucket_bytes, spec) for spec in specs)
    else:
        messages = _described_messages(header, src, group, device, what)
    layout: list[tuple] = []
    posted = {}
    if reused and keep is not None:  # every message has a buffer of its own: all receives posted at once
        messages = list(messages)
        for index, message in enumerate(messages):
            raw = _kept_buffer(keep, index, message.size, device)
            posted[index] = (raw, dist.broadcast(raw, src, group=group, async_op=True))
    pending: Bucket | None = None  # received, not yet loaded: loaded while the next bucket arrives
    for index, message in enumerate(messages):
        if index in posted:
            raw, work = posted.pop(index)
        else:
            raw = (_kept_buffer(keep, index, message.size, device) if keep is not None
                   else _receive_buffer(device, index % 2, message.size, message.bucket_bytes))
            work = dist.broadcast(raw, src, group=group, async_op=True)
        if pending is not None:
            load_fn(pending.views())
        work.wait()
        spec = message.spec
        if spec is None:  # the description came inline, after the data
            spec = _described_spec(raw[_align(message.nbytes):message.size].view(torch.int64).cpu(),
                                   message.inline, message.nbytes, what)
        layout.append(spec)
        dtype_name, nbytes, names, shapes, offsets = spec
        pending = Bucket(raw[:nbytes].view(_DTYPES_BY_NAME[dtype_name]), list(names), list(shapes), list(offsets))
        stats.tensors += len(names)
        stats.bytes += nbytes
        stats.buckets += 1
    if pending is not None:
        load_fn(pending.views())
    if not reused:
        layouts[_fingerprint(layout)] = (message.bucket_bytes if layout else 0, layout)
        while len(layouts) > 4:  # a sender that changed its bucket size or model a few times: keep the latest
            layouts.pop(next(iter(layouts)))
    stats.seconds = time.perf_counter() - start
    return stats


_DTYPES_BY_NAME = {str(dtype): dtype for dtype in DTYPES}


def _described_messages(header: torch.Tensor, src: int, group, device, what: str) -> Iterator[_Incoming]:
    """The messages of a sync in the full protocol, each announced by its header (`header`: the first one)."""
    while True:
        dtype, (count, names_len, nbytes, bucket_bytes, inline, last) = read_header(header, Kind.TENSOR, _TAG, what)
        if count == 0:
            return
        words = count * _META_WIDTH + _align(names_len) // 8
        if inline:
            yield _Incoming(nbytes, _align(nbytes) + 8 * words, bucket_bytes, inline=(str(dtype), count, names_len))
        else:
            description = torch.empty(words, dtype=torch.int64, device=device)
            dist.broadcast(description, src, group=group)
            spec = _described_spec(description.cpu(), (str(dtype), count, names_len), nbytes, what)
            yield _Incoming(nbytes, nbytes, bucket_bytes, spec)
        if last:
            return
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        dist.broadcast(header, src, group=group)
        header = header.cpu()


def _described_spec(description: torch.Tensor, inline: tuple, nbytes: int, what: str) -> tuple:
    """A message's layout (see _spec) from its description (_description's words)."""
    dtype_name, count, names_len = inline
    rows = description[:count * _META_WIDTH].view(count, _META_WIDTH).tolist()
    names = bytes(description[count * _META_WIDTH:].view(torch.uint8)[:names_len].numpy()).decode("utf-8")
    names = names.split("\n")
    if len(names) != count:
        raise ExchangeError(f"{what}: a bucket lists {count} tensors but {len(names)} names")
    return (dtype_name, nbytes, tuple(names), tuple(tuple(r[2:2 + r[1]]) for r in rows), tuple(r[0] for r in rows))


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
