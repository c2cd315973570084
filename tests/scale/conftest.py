import pytest
import torch.distributed as dist


@pytest.fixture(scope="module", autouse=True)
def process_without_a_world():
    """`simulate` becomes each rank of a fake world in this process (dist/fake_world.py), which needs the process
    to itself: the one-rank world that earlier in-process tests keep for the session (tests/recipes.py
    `one_rank_world`) is ended here, and made again by the next test that asks for it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
