"""The weight sync's bucket rule as data (dist/bucket_plan.py) against the Bucketer that packs real tensors."""

import torch

from hpc_rlhf.dist import bucket_plan
from hpc_rlhf.dist.weight_sync import Bucketer


def test_large_tensors_go_alone_small_ones_fill_buckets_per_dtype():
    mb = 2**20
    tensors = [("a", mb // 4, "f32", 4), ("b", mb // 8, "f32", 4), ("big", 5 * mb // 4, "f32", 4),
               ("c", mb // 4, "f32", 4), ("h", 100, "f16", 2), ("d", mb // 4, "f32", 4)]
    got = [(m.tensors, m.nbytes, m.straight_through) for m in bucket_plan.messages(tensors, 2 * mb)]
    # buckets of 2 MB: a (1 MB) + b (0.5 MB) open one; `big` (5 MB) goes straight through at once; c does not
    # fit beside a and b, so their bucket goes; the rest (c + d, and the f16 bucket) at the end, by dtype
    assert got == [(["big"], 5 * mb, True), (["a", "b"], 1.5 * mb, False), (["c", "d"], 2 * mb, False),
                   (["h"], 200, False)]


def test_the_rule_gives_the_bucketers_messages():
    torch.manual_seed(0)
    named = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (n, dtype) in enumerate(
        [(300_000, torch.float32), (2_000_000, torch.float32), (1000, torch.bfloat16), (200_000, torch.float32),
         (150_000, torch.float32), (500, torch.bfloat16), (1_200_000, torch.float32)])]
    bucket_bytes = 2 * 2**20
    real = [(b.names, b.nbytes) for b in Bucketer(bucket_bytes, torch.device("cpu")).buckets(named)]
    planned = bucket_plan.messages([(n, t.numel(), str(t.dtype), t.element_size()) for n, t in named], bucket_bytes)
    assert real == [(m.tensors, m.nbytes) for m in planned]
