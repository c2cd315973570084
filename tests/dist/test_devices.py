"""Which GPU a rank takes and which GPUs its rollout engine's processes see (hpc_rlhf/dist/devices.py), with
fabricated CUDA_VISIBLE_DEVICES lists: the whole node visible, a subset of a shared node, UUIDs, per-task binding."""

import pytest

from hpc_rlhf.dist.devices import DeviceError, engine_visible_devices, rank_device, visible_gpus
from hpc_rlhf.dist.launch_env import BootstrapError

UUIDS = "GPU-1b2c,GPU-3d4e,GPU-5f60,GPU-7a8b"


def test_the_visible_list_is_read_as_entries_and_unset_means_every_gpu():
    assert visible_gpus({}) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,6,7"}) == ["2", "3", "6", "7"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": UUIDS}) == UUIDS.split(",")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize("local_rank, local_world, count, device", [(0, 8, 8, 0), (5, 8, 8, 5), (3, 4, 8, 3),
                                                                    (3, 4, 1, 0), (0, 1, 1, 0)])
def test_a_rank_takes_its_local_rank_or_its_own_gpu_under_per_task_binding(local_rank, local_world, count, device):
    assert rank_device(local_rank, local_world, count) == device


def test_more_ranks_than_gpus_and_no_gpu_are_refused_naming_the_option():
    with pytest.raises(DeviceError, match=r"local rank 4 .* only 4 CUDA devices .*--gpus-per-node=8"):
        rank_device(4, 8, 4)
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        rank_device(0, 2, 0)
    assert issubclass(DeviceError, BootstrapError)  # one line at start-up, exit 2 (launch/local.py)


@pytest.mark.parametrize("environ, local, expected", [
    ({}, [4, 5], "4,5"),                                                 # unset: the driver's numbers
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, [6, 7], "6,7"),
    ({"CUDA_VISIBLE_DEVICES": "2,3,6,7"}, [2, 3], "6,7"),                # a shared node: the job's GPUs, not 2,3
    ({"CUDA_VISIBLE_DEVICES": UUIDS}, [1, 2], "GPU-3d4e,GPU-5f60"),      # by UUID
])
def test_an_engine_sees_its_ranks_gpus_as_its_driving_rank_names_them(environ, local, expected):
    count = len(visible_gpus(environ) or range(8))
    assert engine_visible_devices(local, environ, count) == expected


def test_per_task_binding_serves_a_one_gpu_engine_and_refuses_a_tensor_parallel_one():
    bound = {"CUDA_VISIBLE_DEVICES": "GPU-5f60"}
    assert engine_visible_devices([5], bound, 1) == "GPU-5f60"  # local index 5 of the node: this task's own GPU
    with pytest.raises(DeviceError, match=r"engine of 2 GPUs .* sees one GPU: .*--gpus-per-task"):
        engine_visible_devices([4, 5], bound, 1)


def test_an_engine_gpu_outside_the_visible_list_is_named():
    with pytest.raises(DeviceError, match="needs GPU 4 of this node, but this rank sees 4"):
        engine_visible_devices([4, 5], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4)
