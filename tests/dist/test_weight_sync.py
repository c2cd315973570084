"""Bucketed weight sync: buckets are laid out right, and receivers end up with the sender's tensors bit for bit."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.dist.exchange import ExchangeError
from hpc_rlhf.dist.weight_sync import Bucketer, load_local_weights

KB = 1024


def mixed_model(seed: int):
    """Tiny Llama (~25K parameters) with layer 0 in bf16 and the rest in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.model.layers[0].to(torch.bfloat16)
    return model


def mixed_module(seed: int) -> torch.nn.Module:
    """A transformers-free stand-in for the distributed case (importing transformers on every rank is slow):
    fp32 and bf16 parameters, two of them larger than the 3 KB buckets used there."""
    torch.manual_seed(seed)
    module = torch.nn.ModuleDict({"embed": torch.nn.Embedding(40, 32), "up": torch.nn.Linear(32, 64),
                                  "norm": torch.nn.LayerNorm(64), "down": torch.nn.Linear(64, 8)})
    module["up"].to(torch.bfloat16)
    module["norm"].to(torch.bfloat16)
    return module


class KeepingEngine:
    """What weight_sync.receive_into needs of an engine that keeps the received buckets (the hf engine's
    adopt_weights, without importing transformers on every rank): parameters become the views."""

    def __init__(self, model):
        self.model = model
        self.received_buffers = []

    def adopt_weights(self, named):
        params = dict(self.model.named_parameters())
        for name, view in named:
            params[name].data = view
        return {id(params[name]) for name, _ in named}


def named_stream(model, release: bool = False):
    """named_parameters as a ZeRO-3 caller would stream them: optionally wiped once the iterator moves on."""
    for name, param in model.named_parameters():
        tensor = param.detach().clone()
        yield name, tensor
        if release:
            tensor.fill_(float("nan") if tensor.is_floating_point() else -1)


# ------------------------------------------------------------------------------------------------- unit
def test_bucketer_groups_by_dtype_flushes_when_full_and_sends_big_tensors_alone():
    tensors = [("a", torch.arange(100, dtype=torch.float32)),            # 400 B
               ("b", torch.arange(60, dtype=torch.bfloat16)),           # 120 B
               ("c", torch.arange(150, dtype=torch.float32).view(10, 15)),  # 600 B: a + c = 1000 B fit
               ("d", torch.arange(10, dtype=torch.float32)),            # 40 B: a + c + d = 1040 B, a new bucket
               ("big", torch.arange(300, dtype=torch.float32)),         # 1200 B >= 1024: alone
               ("e", torch.arange(3, dtype=torch.bfloat16))]
    buckets = list(Bucketer(KB, torch.device("cpu")).buckets(iter(tensors)))
    layout = [(b.flat.dtype, b.names, b.offsets, b.flat.numel()) for b in buckets]
    assert layout == [(torch.float32, ["a", "c"], [0, 100], 250),
                      (torch.float32, ["big"], [0], 300),
                      (torch.bfloat16, ["b", "e"], [0, 60], 63),
                      (torch.float32, ["d"], [0], 10)]
    rebuilt = dict(view for b in buckets for view in b.views())
    for name, tensor in tensors:
        assert rebuilt[name].dtype == tensor.dtype and torch.equal(rebuilt[name], tensor)


def test_bucket_metadata_encodes_offsets_shapes_and_names():
    bucket = next(iter(Bucketer(KB, torch.device("cpu")).buckets(
        [("x.w", torch.zeros(2, 3)), ("y.ünï", torch.zeros(4))])))
    assert bucket.meta()[:, :4].tolist() == [[0, 2, 2, 3], [6, 1, 4, 0]]
    assert bytes(bucket.encoded_names().numpy()).decode("utf-8").split("\n") == ["x.w", "y.ünï"]


def test_pool_lends_two_buffers_and_reuses_them_across_syncs():
    """Double buffering from a pool: a stream of ~20 buckets' worth borrows at most two buffers, and the next
    sync gets the very same buffers back (no fresh allocation per bucket or per sync)."""
    from hpc_rlhf.dist.weight_sync import BucketPool

    pool = BucketPool(KB, torch.device("cpu"))
    tensors = [(f"t{i}", torch.full((100,), float(i))) for i in range(50)]  # 400 B each: 2 per bucket
    seen_buffers = []
    for _ in range(2):
        bucketer = Bucketer(KB, torch.device("cpu"), pool)
        for bucket in bucketer.buckets(iter(tensors)):
            seen_buffers.append(bucket.storage.data_ptr())
            assert all(torch.equal(view, torch.full((100,), float(name[1:]))) for name, view in bucket.views())
            pool.release(bucket.storage)
    assert pool.allocated <= 2 and pool.peak_lent_bytes <= 2 * pool.buffer_bytes
    assert len(set(seen_buffers)) == pool.allocated  # every bucket of both syncs in the same buffers


def test_a_tensor_larger_than_a_bucket_goes_straight_through_uncopied():
    from hpc_rlhf.dist.weight_sync import BucketPool

    pool = BucketPool(KB, torch.device("cpu"))
    big = torch.arange(300, dtype=torch.float32)  # 1200 B >= 1 KB
    (bucket,) = Bucketer(KB, torch.device("cpu"), pool).add("big", big)
    assert bucket.storage is None and bucket.flat.data_ptr() == big.data_ptr() and pool.allocated == 0


def test_a_tensor_of_straight_through_size_goes_alone_even_when_a_bucket_holds_it():
    from hpc_rlhf.dist.weight_sync import STRAIGHT_THROUGH_MB

    size = int(STRAIGHT_THROUGH_MB * 2**20)
    bucketer = Bucketer(4 * size, torch.device("cpu"))  # a bucket that would hold four of them
    large = torch.zeros(size // 4, dtype=torch.float32)
    small = torch.zeros(size // 4 - 1, dtype=torch.float32)
    (bucket,) = bucketer.add("large", large)
    assert bucket.names == ["large"] and bucket.flat.data_ptr() == large.data_ptr()  # uncopied
    assert bucketer.add("small", small) == []  # packed, waiting for the rest of its bucket
    (rest,) = bucketer.flush()
    assert rest.names == ["small"] and rest.flat.data_ptr() != small.data_ptr()


def test_local_load_borrows_at_most_two_buckets(tmp_path):
    from hpc_rlhf.dist import weight_sync

    weight_sync.release_buffers()
    source = mixed_model(0)
    stats = load_local_weights(named_stream(source), lambda views: None, bucket_mb=2 / 1024)
    assert stats.buckets > 3
    assert 0 < stats.peak_buffer_bytes <= 2 * weight_sync.BucketPool(2 * KB, "cpu").buffer_bytes


def test_bad_names_and_sizes_are_refused():
    with pytest.raises(ExchangeError, match="contains a newline"):
        Bucketer(KB, torch.device("cpu")).add("a\nb", torch.zeros(1))
    with pytest.raises(ExchangeError, match="bucket_mb must be positive"):
        load_local_weights([("a", torch.zeros(1))], lambda views: None, bucket_mb=0)


def test_hybrid_load_from_a_released_stream_is_bit_exact():
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

    source, target = mixed_model(0), mixed_model(1)
    engine = HFRolloutEngine(target, pad_id=0, eos_id=1)
    calls = []
    stats = load_local_weights(named_stream(source, release=True),
                               lambda views: calls.append(engine.load_weights(views)), bucket_mb=2 / 1024)
    params = dict(source.named_parameters())
    assert stats.tensors == len(params) == sum(calls) and stats.buckets == len(calls) > 3
    for name, param in target.named_parameters():
        assert param.dtype == params[name].dtype and torch.equal(param, params[name]), name


# ------------------------------------------------------------------------------------------ distributed
def test_weight_sync_is_bit_exact_on_four_ranks():
    from tests.distributed import run_ranks

    proc = run_ranks(4, __file__, "sync", timeout=120)
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("OK")) == \
        [f"OK sync rank {r}" for r in range(4)]


def _sync():
    import itertools
    import time

    import torch.distributed as dist

    from hpc_rlhf.dist import weight_sync
    from hpc_rlhf.dist.weight_sync import receive_weights, send_weights

    rank = dist.get_rank()
    sync_ranks, leader = [0, 2, 3], 0  # rank 1 plays a role outside the weight-sync group
    sync_group = dist.new_group(sync_ranks)
    other_group = dist.new_group([1])
    leader_alone = dist.new_group([leader])
    extra = {"extra.big_fp32": torch.randn(40, 50, generator=torch.Generator().manual_seed(1)),
             "extra.bf16": torch.randn(7, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
             "extra.scalar": torch.tensor(3.5, dtype=torch.float64), "extra.int16": torch.arange(-5, 5).to(torch.int16)}
    bucket_mb = 3 / 1024  # 3 KB: many buckets; the 5 KB embedding and 8 KB extra tensor exceed one

    if rank == leader:
        model = mixed_module(0)
        stream = itertools.chain(named_stream(model, release=True), extra.items())
        stats = send_weights(stream, leader, sync_group, bucket_mb=bucket_mb)
        assert stats.buckets > 5 and stats.tensors == len(list(model.parameters())) + len(extra)
        # double buffering: one buffer being filled per dtype (fp32, bf16, fp64, int16) plus one in flight at
        # most, and the same buffers in the next sync (fp32 and bf16 only: three)
        pool = weight_sync.bucket_pool(bucket_mb, torch.device("cpu"))
        bucket_bytes = pool.buffer_bytes  # a bucket and room for its description
        assert 0 < stats.peak_buffer_bytes <= (4 + 1) * bucket_bytes
        buffers = sorted(b.data_ptr() for b in pool.free)
        again = send_weights(named_stream(mixed_module(0)), leader, sync_group, bucket_mb=bucket_mb)
        assert again.peak_buffer_bytes <= (2 + 1) * bucket_bytes
        assert sorted(b.data_ptr() for b in pool.free) == buffers and pool.allocated == len(buffers)
    elif rank in sync_ranks:
        expected = dict(mixed_module(0).named_parameters())
        model = mixed_module(rank)
        params = dict(model.named_parameters())
        received_extra = {}

        @torch.no_grad()
        def load(views):
            for name, tensor in views:
                if name.startswith("extra."):
                    received_extra[name] = tensor.clone()
                else:
                    params[name].copy_(tensor)

        stats = receive_weights(leader, sync_group, load)
        assert stats.buckets > 5
        for name, param in model.named_parameters():
            assert param.dtype == expected[name].dtype and torch.equal(param, expected[name]), name
        assert set(received_extra) == set(extra)
        for name, tensor in extra.items():
            got = received_extra[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
        again = mixed_module(rank + 10)
        params = dict(again.named_parameters())
        received_extra.clear()
        receive_weights(leader, sync_group, load)  # the second sync: reused receive buffers, same result
        for name, param in again.named_parameters():
            assert torch.equal(param, expected[name]), name
    else:
        dist.barrier(group=other_group)

    # An engine that keeps the received buckets as its weights (weight_sync.receive_into): three syncs, the
    # third with another bucket size (another layout). Its parameters are views into the buffers it keeps; the
    # second sync rewrites them in place (same memory), and after each sync every parameter holds the sender's.
    if rank in sync_ranks:
        kept_sizes = (bucket_mb, bucket_mb, 2 * bucket_mb)
        if rank == leader:
            for seed, size in zip((20, 21, 22), kept_sizes):
                send_weights(named_stream(mixed_module(seed), release=True), leader, sync_group, bucket_mb=size)
            # a sync without one of the parameters: refused by the receivers, which cannot leave it stale
            send_weights(list(named_stream(mixed_module(23)))[1:], leader, sync_group, bucket_mb=bucket_mb)
        else:
            engine = KeepingEngine(mixed_module(rank))
            pointers = None
            for seed, size in zip((20, 21, 22), kept_sizes):
                weight_sync.receive_into(engine, leader, sync_group)
                for name, param in engine.model.named_parameters():
                    assert torch.equal(param, dict(mixed_module(seed).named_parameters())[name]), (seed, name)
                    assert any(param.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                               for b in engine.received_buffers), name  # a view, not a copy
                now = [p.data_ptr() for p in engine.model.parameters()]
                if seed == 21:
                    assert now == pointers  # rewritten in place
                pointers = now
            with pytest.raises(ExchangeError, match="1 parameters of the rollout engine were not in this sync"):
                weight_sync.receive_into(engine, leader, sync_group)

    # reuse_layout (what the RL trainer passes): a first sync as above, then one header and the payloads alone;
    # the same weights bit for bit, on a receiver that keeps the buckets (rank 2) and on one that copies (rank 3).
    if rank in sync_ranks:
        size = bucket_mb
        if rank == leader:
            sent: list[int] = []
            real_broadcast = dist.broadcast

            def counted(*args, **kwargs):
                sent.append(1)
                return real_broadcast(*args, **kwargs)

            messages = []
            dist.broadcast = counted
            try:
                for seed in (30, 31, 32):
                    sent.clear()
                    stats = send_weights(named_stream(mixed_module(seed), release=True), leader, sync_group,
                                         bucket_mb=size, reuse_layout=True)
                    messages.append((len(sent), stats.buckets))
            finally:
                dist.broadcast = real_broadcast
            (first, buckets), second, third = messages
            assert buckets > 3 and first >= 2 * buckets and second == third == (buckets + 1, buckets), messages
            # A stream that is not the one promised is refused (here alone in a group: no receiver waits for it).
            send_weights(named_stream(mixed_module(0)), leader, leader_alone, bucket_mb=size, reuse_layout=True)
            changed = list(named_stream(mixed_module(0)))
            changed[1] = (changed[1][0], changed[1][1][:1])
            with pytest.raises(ExchangeError, match="reuse_layout needs the same tensors in the same order"):
                send_weights(iter(changed), leader, leader_alone, bucket_mb=size, reuse_layout=True)
        else:
            engine = KeepingEngine(mixed_module(rank)) if rank == 2 else None
            for seed in (30, 31, 32):
                expected = dict(mixed_module(seed).named_parameters())
                if engine is not None:
                    weight_sync.receive_into(engine, leader, sync_group)
                    got = dict(engine.model.named_parameters())
                else:
                    got = {}
                    receive_weights(leader, sync_group, lambda views: got.update((n, t.clone()) for n, t in views))
                assert set(got) == set(expected)
                for name, tensor in expected.items():
                    assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (seed, name)

    # A sync whose stream ends with a tensor sent straight through has no partly filled bucket to mark as the
    # last: it ends with an end marker.
    if rank in sync_ranks:
        big = extra["extra.big_fp32"]
        if rank == leader:
            stats = send_weights(iter([("a", big), ("b", big + 1)]), leader, sync_group, bucket_mb=bucket_mb)
            assert stats.buckets == 2
        else:
            got = {}
            stats = receive_weights(leader, sync_group, lambda views: got.update((n, t.clone()) for n, t in views))
            assert stats.buckets == 2
            assert torch.equal(got["a"], big) and torch.equal(got["b"], big + 1)

    # Throughput figure for the report: 42 MB of fp32 in the default 256 MB buckets to the two receivers.
    if rank in sync_ranks:
        dist.barrier(group=sync_group)
        start = time.perf_counter()
        if rank == leader:
            weights = ((f"w{i}", torch.full((1024, 1024), float(i))) for i in range(10))
            send_weights(weights, leader, sync_group)
            print(f"TIMING send_weights 42 MB fp32 to {len(sync_ranks) - 1} ranks: "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
        else:
            got = {}
            receive_weights(leader, sync_group, lambda views: got.update((n, t.clone()) for n, t in views))
            assert all(torch.equal(got[f"w{i}"], torch.full((1024, 1024), float(i))) for i in range(10))
    print(f"OK sync rank {rank}", flush=True)


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"sync": _sync})
