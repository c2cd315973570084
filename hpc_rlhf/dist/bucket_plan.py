"""Which messages a weight sync sends: the bucket rule of hpc_rlhf.dist.weight_sync as data, without torch (the
step-time model, hpc_rlhf.scale.step_time, times the real schedule from it; weight_sync's Bucketer applies the
same rule to real tensors, and tests/scale/test_simulate.py checks that the two give the same messages).

Tensors arrive one at a time, in streaming order. One of at least `straight_through_bytes` (a bucket's size, or
STRAIGHT_THROUGH_MB when buckets are larger) goes alone, from its own storage, and is waited for before the stream
moves on. The others are packed, per dtype, into a bucket of `bucket_bytes`; a tensor that does not fit closes its
dtype's bucket, which goes out while the next ones are gathered. What is left goes at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

# A tensor this large travels alone from its own storage even when it would fit in a bucket: copying it costs
# about what its own message does (CPU, 3 gloo ranks: 6.7 ms to copy 40 MB on the sender, ~0.7 ms a message;
# benchmarks/README.md).
STRAIGHT_THROUGH_MB = 4.0


@dataclass
class Message:
    nbytes: int
    straight_through: bool
    tensors: list[str] = field(default_factory=list)


def straight_through_bytes(bucket_bytes: int) -> int:
    return min(bucket_bytes, int(STRAIGHT_THROUGH_MB * 2**20))


def messages(tensors: Iterable[tuple[str, int, str, int]], bucket_bytes: int) -> list[Message]:
    """The messages of a sync of `tensors` ((name, elements, dtype, bytes per element), in streaming order) in
    buckets of `bucket_bytes`, in the order they are sent."""
    straight = straight_through_bytes(bucket_bytes)
    out: list[Message] = []
    open_: dict[str, tuple[Message, int]] = {}  # dtype -> (bucket, elements in it)
    for name, numel, dtype, size in tensors:
        if numel * size >= straight:
            out.append(Message(numel * size, True, [name]))
            continue
        capacity = bucket_bytes // size
        if dtype in open_ and open_[dtype][1] + numel > capacity:
            out.append(open_.pop(dtype)[0])
        bucket, fill = open_.get(dtype, (Message(0, False), 0))
        bucket.nbytes += numel * size
        bucket.tensors.append(name)
        open_[dtype] = (bucket, fill + numel)
    out += [bucket for bucket, _ in open_.values()]
    return out
