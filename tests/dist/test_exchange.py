"""Exchange of ragged sequences and known-size messages over gloo groups; the header checks that prevent aborts.

Distributed cases run under torchrun (tests/distributed.py); their worker code is at the bottom of this file.
Every rank rebuilds the data any rank sends from a seed, so it can check what it received bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.dist.exchange import (HEADER_LEN, MAX_NDIM, ExchangeError, Kind, code_dtype, dtype_code, make_header,
                                    message_tag, pack_ragged, read_header, unpack_ragged)

DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.int16, torch.bool, torch.float16, torch.uint16]


def make_seqs(seed: int, dtype: torch.dtype, count: int | None = None) -> list[torch.Tensor]:
    """Random 1-D tensors; always includes an empty and a length-1 sequence when count allows."""
    g = torch.Generator().manual_seed(seed)
    if count is None:
        count = int(torch.randint(2, 7, (1,), generator=g))
    lengths = ([0, 1] + torch.randint(0, 40, (max(count - 2, 0),), generator=g).tolist())[:count]
    seqs = []
    for n in lengths:
        if dtype.is_floating_point:
            seqs.append((torch.randn(n, generator=g) * 100).to(dtype))
        elif dtype == torch.bool:
            seqs.append(torch.randint(0, 2, (n,), generator=g).bool())
        elif dtype == torch.uint16:
            seqs.append(torch.randint(0, 65535, (n,), generator=g, dtype=torch.int32).to(torch.uint16))
        else:
            seqs.append(torch.randint(-30000, 30000, (n,), generator=g).to(dtype))
    return seqs


def assert_same_seqs(got: list[torch.Tensor], expected: list[torch.Tensor]):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e), (g, e)


# ------------------------------------------------------------------------------------------------- unit
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_then_unpack_returns_the_sequences(dtype):
    seqs = make_seqs(3, dtype, count=6)
    flat, lengths = pack_ragged(seqs)
    assert flat.dtype == dtype and lengths.tolist() == [len(s) for s in seqs]
    assert flat.numel() == sum(len(s) for s in seqs)
    assert_same_seqs(unpack_ragged(flat, lengths), seqs)


def test_pack_ragged_of_hand_made_sequences():
    flat, lengths = pack_ragged([torch.tensor([4, 5]), torch.tensor([], dtype=torch.int64), torch.tensor([6])])
    assert flat.tolist() == [4, 5, 6] and lengths.tolist() == [2, 0, 1]
    empty_flat, empty_lengths = pack_ragged([], dtype=torch.float16)
    assert empty_flat.dtype == torch.float16 and empty_flat.numel() == 0 and empty_lengths.numel() == 0
    assert unpack_ragged(empty_flat, empty_lengths) == []


def test_pack_and_unpack_name_the_bad_input():
    with pytest.raises(ExchangeError, match="sequence 1 must be a 1-D tensor, got \\(2, 2\\)"):
        pack_ragged([torch.zeros(3), torch.zeros(2, 2)])
    with pytest.raises(ExchangeError, match="sequence 1 is torch.int64 but sequence 0 is torch.float32"):
        pack_ragged([torch.zeros(3), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ExchangeError, match="lengths add up to 4 but the flat tensor has 3"):
        unpack_ragged(torch.zeros(3), torch.tensor([1, 3]))


def test_headers_round_trip_and_report_what_differs():
    header = make_header(Kind.TENSOR, message_tag("logprobs"), torch.bfloat16, (3, 0, 7))
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    assert read_header(header, Kind.TENSOR, message_tag("logprobs"), "t") == (torch.bfloat16, (3, 0, 7))
    with pytest.raises(ExchangeError, match="expected a GATHER message but the sender sent a TENSOR message"):
        read_header(header, Kind.GATHER, message_tag("logprobs"), "t")
    with pytest.raises(ExchangeError, match="tag"):
        read_header(header, Kind.TENSOR, message_tag("values"), "t")
    with pytest.raises(ExchangeError, match="not a message header"):
        read_header(torch.arange(HEADER_LEN), Kind.TENSOR, 0, "t")
    with pytest.raises(ExchangeError, match=f"more than {MAX_NDIM} dimensions"):
        make_header(Kind.TENSOR, 0, torch.float32, (1,) * (MAX_NDIM + 1))
    with pytest.raises(ExchangeError, match="cannot be exchanged"):
        dtype_code(torch.quint8)
    assert all(code_dtype(dtype_code(d)) == d for d in DTYPES)


# ------------------------------------------------------------------------------------------ distributed
def test_exchange_round_trips_on_four_ranks():
    from tests.distributed import run_ranks

    proc = run_ranks(4, __file__, "roundtrip", timeout=120)
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("OK")) == \
        [f"OK roundtrip rank {r}" for r in range(4)]


def test_header_mismatches_raise_clear_errors_on_three_ranks():
    from tests.distributed import run_ranks

    proc = run_ranks(3, __file__, "errors", timeout=120)
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("OK")) == \
        [f"OK errors rank {r}" for r in range(3)]


# -------------------------------------------------------------------------------------------- workers
def _roundtrip():
    import torch.distributed as dist

    from hpc_rlhf.dist import exchange as ex

    rank, world = dist.get_rank(), dist.get_world_size()
    members = [0, 2, 3]
    sub = dist.new_group(members)  # every rank calls new_group, members or not

    # gather_ragged: rank r sends r sequences (rank 0 none) to global rank 2
    mine = make_seqs(200 + rank, torch.float32, count=rank)
    gathered = ex.gather_ragged(mine, dst=2, group=None, tag="scores")
    if rank == 2:
        assert len(gathered) == world
        for r in range(world):
            assert_same_seqs(gathered[r], make_seqs(200 + r, torch.float32, count=r))
        assert len(ex.flatten_ranks(gathered)) == sum(range(world))
    else:
        assert gathered is None

    if rank in members:
        # gather in the subgroup, bf16 (carried as bytes), to a destination that is group rank 1, all ranks
        # sending empty lists but one
        seqs = make_seqs(400, torch.bfloat16) if rank == 3 else []
        got = ex.gather_ragged(seqs, dst=2, group=sub, tag="sparse")
        if rank == 2:
            assert got[0] == [] and got[1] == []
            assert_same_seqs(got[2], make_seqs(400, torch.bfloat16))
    else:
        try:
            ex.gather_ragged([], dst=2, group=sub)
            raise AssertionError("a non-member was allowed to take part")
        except ex.ExchangeError as exc:
            assert "rank 1 is not a member of the group (ranks [0, 2, 3])" in str(exc)

    # post, both ways: rank 3 -> ranks 0 and 2 of the subgroup, directly (small, gloo) and by the group's broadcast
    # (DIRECT_MAX_BYTES = 0); a single consumer always point to point; nothing travels to the sender alone.
    sent = torch.arange(12, dtype=torch.int32) * (rank + 1 if rank == 3 else 0)
    want = torch.arange(12, dtype=torch.int32) * 4
    for direct_max in (ex.DIRECT_MAX_BYTES, 0):
        ex.DIRECT_MAX_BYTES, real = direct_max, ex.DIRECT_MAX_BYTES
        if rank in members:
            buf = sent.clone() if rank == 3 else torch.zeros(12, dtype=torch.int32)
            ex.wait(ex.post(buf, src=3, consumers=[0, 2], group=sub, tag=5))
            assert torch.equal(buf, want), (direct_max, buf)
        ex.DIRECT_MAX_BYTES = real
    assert ex.post(torch.ones(3), src=rank, consumers=[rank]) == []
    if rank == 1:
        try:
            ex.post(torch.ones(3), src=0, consumers=[2, 3], group=None)
            raise AssertionError("a rank outside the message took part")
        except ex.ExchangeError as exc:
            assert "rank 1 is neither the sender nor a consumer" in str(exc)

    # known sizes, point to point: uint16 and bf16 travel as their bytes, bit for bit
    known = torch.arange(12, dtype=torch.float32)
    if rank == 0:
        ex.send_known(known.to(torch.bfloat16), dst=1, numel=12, dtype=torch.bfloat16)
        ex.send_known(torch.arange(7, dtype=torch.int32).to(torch.uint16), dst=1, numel=7, dtype=torch.uint16)
    elif rank == 1:
        assert torch.equal(ex.recv_known(0, numel=12, dtype=torch.bfloat16), known.to(torch.bfloat16))
        assert torch.equal(ex.recv_known(0, numel=7, dtype=torch.uint16),
                           torch.arange(7, dtype=torch.int32).to(torch.uint16))
    print(f"OK roundtrip rank {rank}", flush=True)


def _errors():
    import torch.distributed as dist

    from hpc_rlhf.dist import exchange as ex

    rank = dist.get_rank()

    def expect_error(fn, text):
        try:
            fn()
        except ex.ExchangeError as exc:
            assert text in str(exc), str(exc)
            return
        raise AssertionError(f"no ExchangeError containing {text!r}")

    # Disagreeing dtypes in a gather: every rank sees every header, so all of them raise.
    dtype = torch.int64 if rank == 1 else torch.float32
    expect_error(lambda: ex.gather_ragged(make_seqs(rank, dtype, count=2), dst=0, tag="x"),
                 "ranks send different dtypes (group rank 0: torch.float32, group rank 1: torch.int64")
    # ... another message than the receivers expect (another tag) raises on every rank alike ...
    expect_error(lambda: ex.gather_ragged([torch.zeros(2)], dst=0, tag="values" if rank == 2 else "returns"),
                 "tag")
    # ... and one rank's bad input makes every rank raise.
    mine = [torch.zeros(2, 2)] if rank == 2 else [torch.zeros(2)]
    expect_error(lambda: ex.gather_ragged(mine, dst=0), "must be a 1-D tensor" if rank == 2 else
                 "header of group rank 2: the sending rank could not build its message")

    # A known-size message whose sender holds something else raises on the sender before anything is sent.
    if rank == 0:
        expect_error(lambda: ex.send_known(torch.zeros(4, dtype=torch.int64), dst=1, numel=4, dtype=torch.float32),
                     "the sender's tensor is torch.int64 x 4, but the receivers expect torch.float32 x 4")
        expect_error(lambda: ex.send_known(torch.zeros(3), dst=1, numel=4, dtype=torch.float32),
                     "torch.float32 x 3")

    # ... and the world still works afterwards.
    sent = make_seqs(42, torch.float32)
    got = ex.gather_ragged(sent if rank == 2 else [], dst=2, tag="after")
    if rank == 2:
        assert_same_seqs(got[2], sent)
    print(f"OK errors rank {rank}", flush=True)


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"roundtrip": _roundtrip, "errors": _errors})
