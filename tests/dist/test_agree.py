"""Ranks agreeing on a yes/no in one all-reduce: any rank's flag reaches all, a decider's verdict overrides what
the others pass (worker code at the bottom, 3 gloo ranks)."""

from tests.distributed import run_ranks, run_worker


def test_three_ranks_agree_on_flags_and_on_a_deciders_verdict():
    proc = run_ranks(3, __file__, "agree", timeout=120)
    assert proc.stdout.count("agree ok") == 3, proc.stdout


def _agree() -> None:
    import torch.distributed as dist

    from hpc_rlhf.dist.agree import any_rank, decided_by

    rank = dist.get_rank()
    # rank 1 alone sets the first flag, nobody the second, every rank the third
    assert any_rank([rank == 1, False, True]) == [True, False, True]
    assert any_rank([]) == []
    assert any_rank([None]) == [False]
    # only rank 2's word counts: the others' True is ignored, its False and True are everyone's
    assert decided_by(2, rank != 2) is False
    assert decided_by(2, rank == 2) is True
    assert decided_by(0, None) is False
    print(f"rank {rank}: agree ok", flush=True)


if __name__ == "__main__":
    run_worker({"agree": _agree}, timeout_s=60)
