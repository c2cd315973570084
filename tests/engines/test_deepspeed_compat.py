"""The adapter that keeps DeepSpeed's WORLD collectives inside a role group, and the guard that catches them.

In-process tests use a one-rank gloo world, where the singleton group is a real group that is not WORLD. The
distributed case (4 ranks, worker at the bottom) has two roles issuing different numbers of group-less
deepspeed collectives at the same time, which only completes if each stays inside its own role.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hpc_rlhf.engines import deepspeed_compat
from hpc_rlhf.engines.deepspeed_compat import (DS_GROUP_POSITION, RoleMpu, WorldCollectiveError,
                                               forbid_world_collectives, keep_collectives_in_group,
                                               singleton_group)


@pytest.fixture(scope="module")
def world():
    import deepspeed.comm
    import torch.distributed as dist

    # DeepSpeed insists on LOCAL_RANK, also in a world an earlier module made (its monkeypatch gone with it)
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="hpc_rlhf_compat_store_")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.comm.init_distributed("gloo")  # reuses the world, as deepspeed.initialize does
    yield dist


def test_group_positions_match_the_installed_deepspeed():
    import deepspeed.comm.comm as ds_comm_module

    tree = ast.parse(Path(ds_comm_module.__file__).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name, position in DS_GROUP_POSITION.items():
        arguments = [a.arg for a in functions[name].args.args]
        assert arguments.index("group") == position, (name, arguments)


def test_every_module_holding_assert_ints_is_patched_inside_the_block(world):
    importlib.import_module("deepspeed.runtime.zero.stage3")  # imports every other holder
    from deepspeed.runtime.zero.utils import assert_ints_same_as_other_ranks as original

    holders = {name for name, module in list(sys.modules.items())
               if name.startswith("deepspeed") and getattr(module, "assert_ints_same_as_other_ranks", None) is original}
    # star imports spread it well beyond the modules that use it
    assert {"deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partitioned_param_coordinator",
            "deepspeed.runtime.zero.partition_parameters"} <= holders
    assert {module.__name__ for module in deepspeed_compat.assert_ints_holders()} >= holders
    with keep_collectives_in_group(singleton_group()):
        assert all(sys.modules[name].assert_ints_same_as_other_ranks is not original for name in holders)
        sys.modules["deepspeed.runtime.zero.partitioned_param_coordinator"].assert_ints_same_as_other_ranks([3, 1])
    assert all(sys.modules[name].assert_ints_same_as_other_ranks is original for name in holders)


def test_guard_raises_on_world_collectives_and_lets_group_ones_through(world):
    dist = world
    original_barrier = dist.barrier
    group = singleton_group()
    with forbid_world_collectives() as found:
        with pytest.raises(WorldCollectiveError, match="barrier"):
            dist.barrier()
        with pytest.raises(WorldCollectiveError, match="all_reduce"):
            dist.all_reduce(torch.ones(1), group=dist.group.WORLD)
        value = torch.ones(2)
        dist.all_reduce(value, group=group)
        dist.broadcast(value, src=0, group=group)
        assert torch.equal(value, torch.ones(2))
    assert [call.name for call in found] == ["barrier", "all_reduce"]
    assert "test_deepspeed_compat.py" in found[0].stack
    assert dist.barrier is original_barrier
    dist.barrier()  # outside the block the world is usable again


def test_guard_can_record_instead_of_raising(world):
    dist = world
    with forbid_world_collectives(allowed_world=True) as found:
        dist.barrier()
        value = torch.full((1,), 3.0)
        dist.all_reduce(value)  # issued: one rank, so the sum is the value
    assert [call.name for call in found] == ["barrier", "all_reduce"] and value.item() == 3.0


def test_guard_flags_all_rank_new_group(world):
    dist = world
    with forbid_world_collectives() as found:
        with pytest.raises(WorldCollectiveError, match="new_group"):
            dist.new_group([0])
        dist.new_group([0], use_local_synchronization=True)
    assert [call.name for call in found] == ["new_group"]


def test_guard_sees_deepspeed_comm_including_its_captured_all_gather(world):
    import deepspeed.comm as ds_comm

    with forbid_world_collectives() as found:
        with pytest.raises(WorldCollectiveError):
            ds_comm.barrier()
        with pytest.raises(WorldCollectiveError, match="all_gather_function"):
            ds_comm.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
    assert [call.name for call in found] == ["barrier", "all_gather_function"]


def test_redirect_keeps_groupless_deepspeed_collectives_in_the_group(world):
    import deepspeed.comm as ds_comm

    group = singleton_group()
    original = ds_comm.barrier
    with forbid_world_collectives() as found:
        with keep_collectives_in_group(group):
            ds_comm.barrier()
            value = torch.full((1,), 2.0)
            ds_comm.all_reduce(value)
            ds_comm.broadcast(value, 0)
            with keep_collectives_in_group(group):  # nested: restores the outer redirection
                ds_comm.barrier()
            ds_comm.barrier()
        assert ds_comm.barrier is original
        with pytest.raises(WorldCollectiveError):
            ds_comm.barrier()
    assert [call.name for call in found] == ["barrier"]


def test_world_group_needs_no_redirection(world):
    import deepspeed.comm as ds_comm

    original = ds_comm.barrier
    with keep_collectives_in_group(None):
        assert ds_comm.barrier is original


def test_role_mpu_on_one_rank(world):
    dist = world
    mpu = RoleMpu(None)
    assert mpu.get_data_parallel_group() is dist.group.WORLD
    assert (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == (1, 0)
    assert mpu.get_data_parallel_group_ranks() == [0]
    model_parallel = mpu.get_model_parallel_group()
    assert model_parallel is not None and model_parallel is not dist.group.WORLD
    assert model_parallel is singleton_group()  # created once per process
    assert (dist.get_world_size(model_parallel), mpu.get_model_parallel_world_size()) == (1, 1)


def test_two_roles_issue_different_groupless_collectives_at_the_same_time(tmp_path):
    from tests.distributed import run_ranks

    run_ranks(4, __file__, "roles", str(tmp_path), timeout=120)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert all(r["bare_barrier_caught"] and r["bare_all_reduce_caught"] for r in reports)
    assert all(r["world_collectives"] == [] for r in reports)
    assert [r["all_reduce"] for r in reports] == [1.0, 1.0, 5.0, 5.0]  # sums over {0, 1} and {2, 3}
    assert [r["broadcast"] for r in reports] == [1.0, 1.0, 3.0, 3.0]  # from the last rank of each role
    # assert_ints: the role leader (rank 2) never complains; rank 3 does, naming the leader
    assert reports[2]["assert_ints"] == ["ok", "ok", "ok"]
    assert reports[3]["assert_ints"][0] == "ok"
    assert "3 entries, the role leader (rank 2) has 2" in reports[3]["assert_ints"][1]
    assert "disagrees with the role leader (rank 2)" in reports[3]["assert_ints"][2]


# ------------------------------------------------------------------------------------------------ worker
def roles_worker(out_dir: str) -> None:
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    out = Path(out_dir)
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    ds_comm.init_distributed("gloo")
    report = {}
    with forbid_world_collectives() as found:
        for name, call in [("bare_barrier_caught", dist.barrier),
                           ("bare_all_reduce_caught", lambda: dist.all_reduce(torch.ones(1)))]:
            try:
                call()
                report[name] = False
            except WorldCollectiveError:
                report[name] = True
        found.clear()
        with keep_collectives_in_group(group):
            # Role {0, 1} issues three barriers, role {2, 3} one: on WORLD these would pair up across roles.
            for _ in range(3 if rank < 2 else 1):
                ds_comm.barrier()
            value = torch.tensor([float(rank)])
            ds_comm.all_reduce(value)
            report["all_reduce"] = value.item()
            source = 1 if rank < 2 else 3
            value = torch.tensor([float(rank)])
            ds_comm.broadcast(value, source)
            report["broadcast"] = value.item()
            if rank >= 2:
                from deepspeed.runtime.zero import utils as zero_utils

                report["assert_ints"] = []
                for ints in ([5, 6], [5, 6] if rank == 2 else [5, 6, 7], [5, 6] if rank == 2 else [5, 9]):
                    try:
                        zero_utils.assert_ints_same_as_other_ranks(ints)
                        report["assert_ints"].append("ok")
                    except RuntimeError as error:
                        report["assert_ints"].append(str(error))
        report["world_collectives"] = [call.name for call in found]
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"roles": roles_worker})
