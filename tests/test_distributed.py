"""The worker side of the distributed tests (tests/distributed.py's run_worker); its runs on several ranks are the
distributed tests themselves (tests/dist, tests/engines, tests/rl/test_messages.py)."""

import sys

import pytest
import torch.distributed as dist

from tests.distributed import run_worker


def never_called(*args, **kwargs):
    raise AssertionError("called for a case that does not exist")


CASES = {"sync": never_called, "two-roles": never_called}


def test_an_unknown_case_is_named_with_the_known_ones_before_any_world_is_joined(monkeypatch):
    monkeypatch.setattr(dist, "init_process_group", never_called)
    monkeypatch.setattr(sys, "argv", ["/repo/tests/test_something.py", "two_roles", "/tmp/out"])
    with pytest.raises(SystemExit, match=r"^test_something.py: no worker case 'two_roles'; its cases: sync, "
                                         r"two-roles$"):
        run_worker(CASES)
    monkeypatch.setattr(sys, "argv", ["/repo/tests/test_something.py"])
    with pytest.raises(SystemExit, match=r"^test_something.py: no worker case given; its cases: sync, two-roles$"):
        run_worker(CASES)
