"""hpc_rlhf/dist/bandwidth.py: the bus-bandwidth factor of nccl-tests on hand-computed cases. The command itself
runs across two ranks on two nodes in sbatch/smoke_gpu.sbatch's shrunk job (tests/cluster)."""

import pytest

from hpc_rlhf.dist.bandwidth import Bandwidth, bus_factor


@pytest.mark.parametrize("ranks, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (32, 1.9375)])
def test_the_bus_factor_is_what_a_ring_carries_per_byte(ranks, factor):
    assert bus_factor(ranks) == factor


def test_bandwidths_of_a_measured_all_reduce():
    measured = Bandwidth(ranks=8, size_bytes=256_000_000, seconds=0.004)  # 256 MB in 4 ms
    assert measured.algbw_gbps == pytest.approx(64.0) and measured.busbw_gbps == pytest.approx(112.0)
    assert measured.line("nccl") == ("all-reduce of 256 MB over 8 ranks (nccl): 4.00 ms, algorithm bandwidth 64.00 "
                                     "GB/s, bus bandwidth 112.00 GB/s")
