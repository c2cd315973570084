"""Moving tensors between ranks: headed gathers of ragged sequences, known-size messages, and the headers that keep
a disagreement from aborting a process (DESIGN §9). It moves bytes; which message goes to whom is the caller's
(the RL recipe's route table, hpc_rlhf/rl/messages.py).

Two kinds of message, by what the receiver knows in advance:
- known size: both sides derive the dtype and size from state they share (the RL step's responses, padded to a
  size every rank knows, and its scores, whose lengths follow from the responses), so one message carries the
  values and nothing else: `post` (one sender, any consumers; point to point or a broadcast over the group the
  caller gives), `send_known`/`recv_known` for two ranks. A collective whose dtype or size differs between sender
  and receiver aborts the receiving process, so the sender checks what it sends against the size both sides
  expect, and raises before sending when they differ.
- headed: `gather_ragged` (a role's per-sample results to its leader: every rank's count and total differ) first
  all-gathers a fixed-size int64 header (HEADER_LEN values: magic, message kind, tag, dtype code, ndim, shape) from
  every rank, so every rank can size its buffers and every rank sees a disagreement (another message, another tag,
  another dtype) and raises alike; a rank whose own input is wrong sends a FAILED header so that its peers raise
  too instead of waiting. The weight sync (weight_sync.py) speaks the same headers. No message is pickled.

Ranks: `src`/`dst` are global ranks (as in torch.distributed); results of gathers are listed in group-rank order.
Tensors travel on the group's device: the current CUDA device for NCCL groups, the CPU otherwise. A ragged list is
packed as one flat tensor plus an int64 lengths tensor (`pack_ragged`). dtypes that gloo does not carry travel as
their bytes, bit-exact.
"""

from __future__ import annotations

import enum
import zlib
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

MAX_NDIM = 8
HEADER_LEN = 16
_MAGIC = 0x68726C66  # "hrlf": tells a header from anything else that might land in its place

# Position in this tuple is the dtype's code on the wire; append only, never reorder.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64, torch.complex128,
)
# dtypes every backend carries as they are; the others travel as their bytes (gloo refuses int16, uint16,
# float8, ...), which keeps them bit-exact.
_NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool}
_NO_DTYPE = -1  # a gather participant with nothing to send, whose dtype is therefore unknown


class Kind(enum.IntEnum):
    """What a header announces; the values are codes on the wire (2 and 3 were ragged lists and dict batches)."""
    TENSOR = 1
    GATHER = 4
    FAILED = 5  # sent in place of a header by a rank whose own input was wrong, so its peers raise too


class ExchangeError(RuntimeError):
    """Sender and receiver disagree about a message (kind, tag, keys, dtype), or the call itself is wrong."""


# ------------------------------------------------------------------------------------------------- headers
def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES.index(dtype)
    except ValueError:
        raise ExchangeError(f"dtype {dtype} cannot be exchanged; supported: "
                            f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}") from None


def code_dtype(code: int) -> torch.dtype:
    if not 0 <= code < len(DTYPES):
        raise ExchangeError(f"header names dtype code {code}, which this version does not know")
    return DTYPES[code]


def message_tag(name: str) -> int:
    """Small stable integer for a message name (a batch key, a protocol step), checked by the receiver."""
    return zlib.crc32(name.encode("utf-8"))


def make_header(kind: Kind, tag: int, dtype: torch.dtype | None, shape: Sequence[int]) -> torch.Tensor:
    if len(shape) > MAX_NDIM:
        raise ExchangeError(f"tensors of more than {MAX_NDIM} dimensions cannot be exchanged, got shape "
                            f"{tuple(shape)}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:5] = torch.tensor([_MAGIC, int(kind), tag, _NO_DTYPE if dtype is None else dtype_code(dtype),
                               len(shape)])
    header[5:5 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return header


def read_header(header: torch.Tensor, kind: Kind, tag: int, what: str) -> tuple[torch.dtype | None, tuple]:
    """(dtype, shape) of a header, after checking it is the message this receiver is waiting for."""
    values = header.tolist()
    if values[0] != _MAGIC:
        raise ExchangeError(f"{what}: received something that is not a message header (sender and receiver "
                            "are not running the same exchange sequence)")
    if values[1] == Kind.FAILED:
        raise ExchangeError(f"{what}: the sending rank could not build its message (its own error says why)")
    if values[1] != int(kind):
        sent = Kind(values[1]).name if values[1] in Kind._value2member_map_ else values[1]
        raise ExchangeError(f"{what}: expected a {kind.name} message but the sender sent a {sent} message")
    if values[2] != tag:
        raise ExchangeError(f"{what}: the sender's message has tag {values[2]}, this receiver expects {tag} "
                            "(the two sides name different messages or keys)")
    ndim = values[4]
    if not 0 <= ndim <= MAX_NDIM:
        raise ExchangeError(f"{what}: header has {ndim} dimensions")
    dtype = None if values[3] == _NO_DTYPE else code_dtype(values[3])
    return dtype, tuple(values[5:5 + ndim])


# ---------------------------------------------------------------------------------------------- utilities
def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _check_member(group, root: int | None, what: str) -> list[int]:
    # A collective on a group this rank is not in returns None without a word (DESIGN §9): refuse instead.
    ranks = group_ranks(group)
    me = dist.get_rank()
    if me not in ranks:
        raise ExchangeError(f"{what}: rank {me} is not a member of the group (ranks {ranks})")
    if root is not None and root not in ranks:
        raise ExchangeError(f"{what}: rank {root} is not a member of the group (ranks {ranks}); src/dst are "
                            "global ranks")
    return ranks


def _failed_header() -> torch.Tensor:
    return make_header(Kind.FAILED, 0, None, ())


def _to_wire(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    flat = t.detach().reshape(-1).to(device).contiguous()
    return flat if flat.dtype in _NATIVE else flat.view(torch.uint8)


def _wire_buffer(dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    if dtype in _NATIVE:
        return torch.empty(numel, dtype=dtype, device=device)
    return torch.empty(numel * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8, device=device)


def _from_wire(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return (buf if buf.dtype == dtype else buf.view(dtype)).reshape(shape)


# ------------------------------------------------------------------------------------------------- ragged
def pack_ragged(seqs: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D tensors -> (one flat tensor, int64 lengths). An empty list needs `dtype` (default int64)."""
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor) or s.dim() != 1:
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ExchangeError(f"pack_ragged: sequence {i} must be a 1-D tensor, got {shape}")
        if s.dtype != seqs[0].dtype:
            raise ExchangeError(f"pack_ragged: sequence {i} is {s.dtype} but sequence 0 is {seqs[0].dtype}")
    if dtype is not None and seqs and seqs[0].dtype != dtype:
        raise ExchangeError(f"pack_ragged: sequences are {seqs[0].dtype}, not the requested {dtype}")
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    if not seqs:
        return torch.empty(0, dtype=dtype or torch.int64), lengths
    return torch.cat([s.detach() for s in seqs]), lengths


def unpack_ragged(flat: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of pack_ragged. The pieces are views of `flat`."""
    sizes = [int(n) for n in lengths.tolist()]
    if sum(sizes) != flat.numel() or any(n < 0 for n in sizes):
        raise ExchangeError(f"unpack_ragged: lengths add up to {sum(sizes)} but the flat tensor has "
                            f"{flat.numel()} elements")
    return list(torch.split(flat.reshape(-1), sizes)) if sizes else []


# ------------------------------------------------------------------------------------------------ messages
DIRECT_MAX_BYTES = 1 << 20  # on gloo, a message up to this size goes to each consumer directly (see `post`)


def _check_known(t, numel: int, dtype: torch.dtype, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel:
        got = f"{t.dtype} x {t.numel()}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ExchangeError(f"{what}: the sender's tensor is {got}, but the receivers expect {dtype} x {numel} "
                            "(sizes derived from shared state disagree: a bug, not bad input)")


def goes_direct(nbytes: int, consumers: int, backend: str) -> bool:
    """Whether `post` sends a message of `nbytes` to `consumers` ranks point to point rather than by a collective:
    a single consumer always; several when `fans_out_directly`."""
    return consumers == 1 or fans_out_directly(nbytes, backend)


def fans_out_directly(nbytes: int, backend: str) -> bool:
    """Whether a message of `nbytes` for several ranks goes to each of them point to point: on gloo up to
    DIRECT_MAX_BYTES. Other backends (NCCL, the fake backend of hpc_rlhf.dist.fake_world) use a collective over a
    group: NCCL sets up a communicator for every pair of ranks that talk point to point, a group has one."""
    return backend == "gloo" and nbytes <= DIRECT_MAX_BYTES


def post(buffer: torch.Tensor, src: int, consumers: Sequence[int], group: dist.ProcessGroup | None = None,
         tag: int = 0) -> list:
    """Start moving `buffer` (1-D, on this rank's communication device) from global rank `src` to the global ranks
    `consumers`; this rank is `src` or one of them. Returns the works to wait for (`wait`), none if nothing travels.

    The message's size and dtype are known to both sides from state they share (DESIGN §9: the alternative to a
    header), so a consumer passes a buffer of the same size and dtype, which it finds filled after the wait. It
    travels point to point to a single consumer, and on gloo to each consumer when it is at most DIRECT_MAX_BYTES:
    gloo runs a broadcast on the group's worker thread, along a binomial tree (a consumer can get the message
    through another consumer), so each message waits for one or two more threads to be scheduled; where ranks share
    cores that is what a message of a few kilobytes costs. Otherwise it is a broadcast over `group`, whose ranks
    must be exactly `src` and `consumers` (the caller's route table gives it). `tag` tells apart the messages of
    one round that travel between the same two ranks; every rank passes the same one for the same message."""
    me, consumers = dist.get_rank(), [r for r in consumers if r != src]
    if not consumers or not buffer.numel():
        return []
    if me != src and me not in consumers:
        raise ExchangeError(f"post from rank {src}: rank {me} is neither the sender nor a consumer ({consumers})")
    if not goes_direct(buffer.numel() * buffer.element_size(), len(consumers), backend_of(group)):
        if group is None:
            raise ExchangeError(f"post from rank {src} to {len(consumers)} ranks needs the group of those ranks")
        return [dist.broadcast(buffer, src, group=group, async_op=True)]
    if me == src:
        return [dist.isend(buffer, other, tag=tag) for other in consumers]
    return [dist.irecv(buffer, src, tag=tag)]


def backend_of(group: dist.ProcessGroup | None = None) -> str:
    """The backend of `group` (None: the default group), as torch names it: "gloo", "nccl", "fake", ..."""
    return str(dist.get_backend(group))


def gather_known(buffer: torch.Tensor, dst: int, group: dist.ProcessGroup) -> list[torch.Tensor] | None:
    """Every rank of `group` sends `buffer` (1-D, the same size and dtype on every rank: known to all from state
    they share) to global rank `dst`, which gets them in group-rank order; None elsewhere."""
    _check_member(group, dst, "gather_known")
    if dist.get_rank() != dst:
        dist.gather(buffer, None, dst=dst, group=group)
        return None
    out = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
    dist.gather(buffer, out, dst=dst, group=group)
    return out


def wait(works: Iterable) -> None:
    for work in works:
        work.wait()


def send_known(t: torch.Tensor, dst: int, numel: int, dtype: torch.dtype) -> None:
    """`t` (`numel` values of `dtype`, known to both sides) to global rank `dst`, which calls `recv_known`."""
    _check_known(t, numel, dtype, f"send_known to rank {dst}")
    wait(post(_to_wire(t, comm_device()), dist.get_rank(), [dst]))


def recv_known(src: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _wire_buffer(dtype, numel, comm_device())
    wait(post(buf, src, [dist.get_rank()]))
    return _from_wire(buf, dtype, (numel,)).cpu()


# ------------------------------------------------------------------------------------------------ gathers
def _ragged_headers(seqs: Sequence[torch.Tensor], tag: str, dtype: torch.dtype | None, group, device, what):
    """All-gather every rank's (dtype, count, total) and agree on one dtype, raising alike on every rank."""
    seqs = list(seqs)
    try:
        flat, lengths = pack_ragged(seqs, dtype)
        known = flat.dtype if (seqs or dtype is not None) else None
        header = make_header(Kind.GATHER, message_tag(tag), known, (len(lengths), flat.numel()))
        error = None
    except ExchangeError as exc:
        header, error = _failed_header(), exc
    size = dist.get_world_size(group)
    headers = [torch.zeros(HEADER_LEN, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(headers, header.to(device), group=group)
    if error is not None:
        raise error
    described = [read_header(h.cpu(), Kind.GATHER, message_tag(tag), f"{what}, header of group rank {r}")
                 for r, h in enumerate(headers)]
    dtypes = {d for d, _ in described if d is not None}
    if len(dtypes) > 1:
        by_rank = ", ".join(f"group rank {r}: {d}" for r, (d, _) in enumerate(described))
        raise ExchangeError(f"{what}: ranks send different dtypes ({by_rank})")
    agreed = dtypes.pop() if dtypes else (dtype or torch.int64)
    if len(flat) == 0:
        flat = flat.to(agreed)
    counts = [shape[0] for _, shape in described]
    totals = [shape[1] for _, shape in described]
    return flat, lengths, agreed, counts, totals


def _padded(t: torch.Tensor, size: int, device) -> torch.Tensor:
    out = torch.zeros(size, dtype=t.dtype, device=device)
    out[:len(t)] = t.to(device)
    return out


def _split_by_rank(length_bufs, flat_bufs, counts, totals, dtype) -> list[list[torch.Tensor]]:
    per_rank = []
    for lengths, flat, count, total in zip(length_bufs, flat_bufs, counts, totals):
        values = _from_wire(flat, dtype, (-1,))[:total] if flat is not None else torch.empty(0, dtype=dtype)
        per_rank.append(unpack_ragged(values.cpu(), lengths[:count].cpu()))
    return per_rank


def gather_ragged(seqs: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None = None,
                  tag: str = "gather", dtype: torch.dtype | None = None) -> list[list[torch.Tensor]] | None:
    """Every rank's list of 1-D tensors (any count, any lengths) to global rank `dst`.

    `dst` gets one list per group rank, in group-rank order (tensors on the CPU); the others get None.
    Headers are all-gathered first so every rank can pad to the largest count and total (gather needs equal
    sizes); the bulk goes to `dst` only.
    """
    what = f"gather_ragged('{tag}')"
    _check_member(group, dst, what)
    device = comm_device(group)
    flat, lengths, agreed, counts, totals = _ragged_headers(seqs, tag, dtype, group, device, what)
    size, is_dst = dist.get_world_size(group), dist.get_rank() == dst
    max_count, max_total = max(counts), max(totals)
    length_bufs = [torch.zeros(max_count, dtype=torch.int64, device=device) for _ in range(size)]
    flat_bufs = [_wire_buffer(agreed, max_total, device) for _ in range(size)] if max_total else [None] * size
    if max_count:
        dist.gather(_padded(lengths, max_count, device), length_bufs if is_dst else None, dst=dst, group=group)
    if max_total:
        mine = _padded(_to_wire(flat, device), flat_bufs[0].numel(), device)
        dist.gather(mine, flat_bufs if is_dst else None, dst=dst, group=group)
    if not is_dst:
        return None
    return _split_by_rank(length_bufs, flat_bufs, counts, totals, agreed)


def flatten_ranks(per_rank: Iterable[list[torch.Tensor]]) -> list[torch.Tensor]:
    """[[rank 0's sequences], [rank 1's], ...] -> one list, rank by rank."""
    return [t for seqs in per_rank for t in seqs]
