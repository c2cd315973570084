"""Moving experience between role groups as tensors: ragged sequences, batches, gathers (DESIGN §4, §9).

Every message starts with a fixed-size int64 header (HEADER_LEN values: magic, message kind, tag, dtype code,
ndim, shape). A collective whose dtype or size differs between sender and receiver aborts the receiving
process, so nothing of variable size or dtype is received before a header has described it; a header that
is not what the receiver expects (another kind of message, another tag, a different key list) raises
`ExchangeError` on the receiver instead. A sender whose own input is wrong sends a FAILED header in place of
its message, so its receivers raise too instead of waiting. In gathers every rank sees every header, so a
disagreement raises on all ranks alike and nobody is left waiting. No message is pickled.

Ranks: `src`/`dst` are global ranks (as in torch.distributed); results of gathers are listed in group-rank
order. Tensors travel on the group's device: the current CUDA device for NCCL groups, the CPU otherwise.
A ragged list is packed as one flat tensor plus an int64 lengths tensor (`pack_ragged`), which travel as one
payload after the header, so a batch of sequences costs two messages whatever its size. A tensor whose dtype
and size both sides derive from state they share (`broadcast_known`, `send_known`) travels as one message
without a header: on a CPU cluster and for the small experience tensors of an RL step, messages cost latency
rather than bandwidth.
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
    TENSOR = 1
    RAGGED = 2
    BATCH = 3
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


def _announce(header: torch.Tensor | None, src: int, group, device) -> torch.Tensor:
    """Broadcast the source's header; a source that failed to build one (None) sends FAILED instead, so the
    receivers raise rather than wait for a message that will never come."""
    out = (header if header is not None else _failed_header()).to(device)
    dist.broadcast(out, src, group=group)
    return out


def _to_wire(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    flat = t.detach().reshape(-1).to(device).contiguous()
    return flat if flat.dtype in _NATIVE else flat.view(torch.uint8)


def _wire_buffer(dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    if dtype in _NATIVE:
        return torch.empty(numel, dtype=dtype, device=device)
    return torch.empty(numel * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8, device=device)


def _from_wire(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return (buf if buf.dtype == dtype else buf.view(dtype)).reshape(shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


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


def _lengths_bytes(count: int) -> int:
    return (count * 8 + 15) // 16 * 16  # so the values behind the lengths are aligned for any dtype


def _ragged_payload_bytes(dtype: torch.dtype, count: int, total: int) -> int:
    return _lengths_bytes(count) + total * torch.empty((), dtype=dtype).element_size()


def _ragged_payload(flat: torch.Tensor, lengths: torch.Tensor, device) -> torch.Tensor:
    """The lengths and the values of a ragged list as one uint8 message (bit for bit, any dtype)."""
    payload = torch.zeros(_ragged_payload_bytes(flat.dtype, len(lengths), flat.numel()), dtype=torch.uint8,
                          device=device)
    head = _lengths_bytes(len(lengths))
    payload[:len(lengths) * 8] = lengths.to(device).view(torch.uint8)
    if flat.numel():
        payload[head:] = flat.detach().reshape(-1).to(device).contiguous().view(torch.uint8)
    return payload


def _unpack_payload(payload: torch.Tensor, dtype: torch.dtype, count: int, total: int) -> list[torch.Tensor]:
    lengths = payload[:count * 8].view(torch.int64).cpu()
    values = payload[_lengths_bytes(count):].view(dtype) if total else torch.empty(0, dtype=dtype)
    return unpack_ragged(values, lengths)


def unpack_ragged(flat: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of pack_ragged. The pieces are views of `flat`."""
    sizes = [int(n) for n in lengths.tolist()]
    if sum(sizes) != flat.numel() or any(n < 0 for n in sizes):
        raise ExchangeError(f"unpack_ragged: lengths add up to {sum(sizes)} but the flat tensor has "
                            f"{flat.numel()} elements")
    return list(torch.split(flat.reshape(-1), sizes)) if sizes else []


# --------------------------------------------------------------------------------------------- broadcasts
def broadcast_tensor(t: torch.Tensor | None, src: int, group: dist.ProcessGroup | None = None,
                     tag: str = "tensor") -> torch.Tensor:
    """`t` from global rank `src` to every rank of `group` (any dtype in DTYPES, any shape up to MAX_NDIM).

    Receivers pass None (their argument is ignored) and get a new tensor on the group's device; `src` gets
    `t` back. `tag` names the message: a receiver expecting another tag raises ExchangeError.
    """
    what = f"broadcast_tensor('{tag}')"
    _check_member(group, src, what)
    device = comm_device(group)
    if dist.get_rank() == src:
        header, error = None, None
        try:
            if not isinstance(t, torch.Tensor):
                raise ExchangeError(f"{what}: the source rank {src} must pass a tensor, got {type(t).__name__}")
            header = make_header(Kind.TENSOR, message_tag(tag), t.dtype, t.shape)
        except ExchangeError as exc:
            error = exc
        _announce(header, src, group, device)
        if error is not None:
            raise error
        if t.numel():
            dist.broadcast(_to_wire(t, device), src, group=group)
        return t
    header = _announce(torch.zeros(HEADER_LEN, dtype=torch.int64), src, group, device)
    dtype, shape = read_header(header.cpu(), Kind.TENSOR, message_tag(tag), what)
    buf = _wire_buffer(dtype, _numel(shape), device)
    if buf.numel():
        dist.broadcast(buf, src, group=group)
    return _from_wire(buf, dtype, shape)


def broadcast_ragged(seqs: Sequence[torch.Tensor] | None, src: int, group: dist.ProcessGroup | None = None,
                     tag: str = "ragged", dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """A list of 1-D tensors of any lengths (empty list and empty tensors included) from `src` to the group."""
    what = f"broadcast_ragged('{tag}')"
    _check_member(group, src, what)
    device = comm_device(group)
    if dist.get_rank() == src:
        header, error = None, None
        try:
            if seqs is None:
                raise ExchangeError(f"{what}: the source rank {src} must pass a list of tensors, got None")
            flat, lengths = pack_ragged(list(seqs), dtype)
            header = make_header(Kind.RAGGED, message_tag(tag), flat.dtype, (len(lengths), flat.numel()))
        except ExchangeError as exc:
            error = exc
        _announce(header, src, group, device)
        if error is not None:
            raise error
        if len(lengths):
            dist.broadcast(_ragged_payload(flat, lengths, device), src, group=group)
        return list(seqs)
    header = _announce(torch.zeros(HEADER_LEN, dtype=torch.int64), src, group, device)
    dtype, (count, total) = read_header(header.cpu(), Kind.RAGGED, message_tag(tag), what)
    payload = torch.empty(_ragged_payload_bytes(dtype, count, total), dtype=torch.uint8, device=device)
    if count:
        dist.broadcast(payload, src, group=group)
    return _unpack_payload(payload, dtype, count, total)


def broadcast_batch(batch: dict[str, torch.Tensor] | None, src: int, group: dist.ProcessGroup | None,
                    keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """A dict of tensors whose key list both sides know from code; one header row per tensor.

    The key list itself is checked first (its count and a checksum of the names, in a fixed-size header),
    so a receiver whose code expects other keys raises before any payload arrives, naming the keys that
    differ. (The sender cannot know; if it has non-empty payloads left it waits for them to be taken until the
    group's timeout.)
    """
    keys = list(keys)
    what = f"broadcast_batch(keys={keys})"
    _check_member(group, src, what)
    device = comm_device(group)
    is_src = dist.get_rank() == src
    list_tag = message_tag("\0".join(keys))
    if is_src:
        header, error = None, None
        try:
            if batch is None or set(batch) != set(keys):
                got = sorted(batch) if batch is not None else None
                raise ExchangeError(f"{what}: the source rank {src} must pass a dict with exactly these keys, "
                                    f"got {got}")
            rows = torch.stack([make_header(Kind.TENSOR, message_tag(k), batch[k].dtype, batch[k].shape)
                                for k in keys])
            header = make_header(Kind.BATCH, list_tag, None, (len(keys),))
        except ExchangeError as exc:
            error = exc
        _announce(header, src, group, device)
        if error is not None:
            raise error
    else:
        rows = torch.zeros(len(keys), HEADER_LEN, dtype=torch.int64)
        header = _announce(torch.zeros(HEADER_LEN, dtype=torch.int64), src, group, device).cpu()
        _, (count,) = read_header(header, Kind.BATCH, int(header[2]), what)
        if count != len(keys):
            raise ExchangeError(f"{what}: the sender sends {count} tensors, this receiver expects {len(keys)}")
    rows = rows.to(device)
    # Equal counts: the rows have the same size on both sides, so take them before judging the key names;
    # the sender then only has payloads left to send, and none when its tensors are empty.
    dist.broadcast(rows, src, group=group)
    if not is_src and int(header[2]) != list_tag:
        sent = rows.cpu()[:, 2].tolist()
        wrong = [f"'{k}' (position {i})" for i, k in enumerate(keys) if message_tag(k) != sent[i]]
        raise ExchangeError(f"{what}: the sender's keys differ from this receiver's at {', '.join(wrong)}")
    if is_src:
        for k in keys:
            if batch[k].numel():
                dist.broadcast(_to_wire(batch[k], device), src, group=group)
        return dict(batch)
    received = {}
    rows = rows.cpu()
    for k, row in zip(keys, rows):
        dtype, shape = read_header(row, Kind.TENSOR, message_tag(k), f"{what}, key '{k}'")
        buf = _wire_buffer(dtype, _numel(shape), device)
        if buf.numel():
            dist.broadcast(buf, src, group=group)
        received[k] = _from_wire(buf, dtype, shape)
    return received


# ------------------------------------------------------------------------------------------ point to point
def send_ragged(seqs: Sequence[torch.Tensor], dst: int, tag: str = "ragged",
                dtype: torch.dtype | None = None) -> None:
    """A list of 1-D tensors from this rank to global rank `dst`, which calls `recv_ragged` (no group needed:
    for a message with one consumer, a point-to-point send instead of a broadcast over a two-rank group)."""
    what = f"send_ragged('{tag}')"
    device = comm_device()
    header, error = None, None
    try:
        if seqs is None:
            raise ExchangeError(f"the sending rank {dist.get_rank()} must pass a list of tensors, got None")
        flat, lengths = pack_ragged(list(seqs), dtype)
        header = make_header(Kind.RAGGED, message_tag(tag), flat.dtype, (len(lengths), flat.numel()))
    except ExchangeError as exc:
        error = exc
    dist.send((header if header is not None else _failed_header()).to(device), dst)
    if error is not None:
        raise ExchangeError(f"{what}: {error}") from None
    if len(lengths):
        dist.send(_ragged_payload(flat, lengths, device), dst)


def recv_ragged(src: int, tag: str = "ragged") -> list[torch.Tensor]:
    """What global rank `src` sends with `send_ragged` (same tag)."""
    what = f"recv_ragged('{tag}')"
    device = comm_device()
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, (count, total) = read_header(header.cpu(), Kind.RAGGED, message_tag(tag), what)
    payload = torch.empty(_ragged_payload_bytes(dtype, count, total), dtype=torch.uint8, device=device)
    if count:
        dist.recv(payload, src)
    return [t.cpu() for t in _unpack_payload(payload, dtype, count, total)]


# ------------------------------------------------------------------------------------- known-size messages
def _check_known(t, numel: int, dtype: torch.dtype, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel:
        got = f"{t.dtype} x {t.numel()}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ExchangeError(f"{what}: the sender's tensor is {got}, but the receivers expect {dtype} x {numel} "
                            "(sizes derived from shared state disagree: a bug, not bad input)")


def broadcast_known(t: torch.Tensor | None, src: int, group: dist.ProcessGroup | None, numel: int,
                    dtype: torch.dtype, tag: str = "known") -> torch.Tensor:
    """A 1-D tensor of `numel` values of `dtype`, which every rank of the group knows from state they share
    (DESIGN §9: the header's alternative): one message, no header. The source checks its tensor first and
    raises without sending when it differs; the watchdog then ends the job (its receivers would wait)."""
    what = f"broadcast_known('{tag}')"
    _check_member(group, src, what)
    device = comm_device(group)
    if dist.get_rank() == src:
        _check_known(t, numel, dtype, what)
        if numel:
            dist.broadcast(_to_wire(t, device), src, group=group)
        return t.reshape(-1)
    buf = _wire_buffer(dtype, numel, device)
    if numel:
        dist.broadcast(buf, src, group=group)
    return _from_wire(buf, dtype, (numel,))


def send_known(t: torch.Tensor, dst: int, numel: int, dtype: torch.dtype, tag: str = "known") -> None:
    """Point-to-point `broadcast_known`: `dst` calls `recv_known` with the same size and dtype."""
    _check_known(t, numel, dtype, f"send_known('{tag}')")
    if numel:
        dist.send(_to_wire(t, comm_device()), dst)


def recv_known(src: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _wire_buffer(dtype, numel, comm_device())
    if numel:
        dist.recv(buf, src)
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


def all_gather_ragged(seqs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                      tag: str = "all_gather", dtype: torch.dtype | None = None) -> list[list[torch.Tensor]]:
    """Every rank's list of 1-D tensors to every rank: one list per group rank, in group-rank order."""
    what = f"all_gather_ragged('{tag}')"
    _check_member(group, None, what)
    device = comm_device(group)
    flat, lengths, agreed, counts, totals = _ragged_headers(seqs, tag, dtype, group, device, what)
    size = dist.get_world_size(group)
    max_count, max_total = max(counts), max(totals)
    length_bufs = [torch.zeros(max_count, dtype=torch.int64, device=device) for _ in range(size)]
    flat_bufs = [_wire_buffer(agreed, max_total, device) for _ in range(size)] if max_total else [None] * size
    if max_count:
        dist.all_gather(length_bufs, _padded(lengths, max_count, device), group=group)
    if max_total:
        dist.all_gather(flat_bufs, _padded(_to_wire(flat, device), flat_bufs[0].numel(), device), group=group)
    return _split_by_rank(length_bufs, flat_bufs, counts, totals, agreed)


def flatten_ranks(per_rank: Iterable[list[torch.Tensor]]) -> list[torch.Tensor]:
    """[[rank 0's sequences], [rank 1's], ...] -> one list, rank by rank."""
    return [t for seqs in per_rank for t in seqs]
