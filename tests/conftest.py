import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): one core each, so that the
# single-threaded tests no longer leave a core idle. Tests that must run one after another on the same worker
# share a group: those that start from the session's SFT base (one worker trains it once, not each worker),
# the local Slurm cluster's (one worker submits every job at once, then waits), and the 6-rank lost-rank jobs
# (one at a time: their bounds are measured from the fault to the job's end). pytest stays below 9: xdist 3.8
# puts a test into its group by renaming its node id, which pytest 9 no longer reads (the groups are ignored).
SERIAL_GROUPS = (("sft_base", lambda item: "sft_base" in item.fixturenames),
                 ("cluster", lambda item: item.nodeid.startswith("tests/cluster/")),
                 ("lost_ranks", lambda item: item.nodeid.startswith("tests/trainers/test_failures.py")))


def pytest_collection_modifyitems(config, items):
    # The groups first, longest first: the SFT base's chain of tests is the longest (~12 minutes), and the Slurm
    # jobs run while their worker waits; the single tests then fill both workers (make test: in this order,
    # --no-loadscope-reorder). A stable sort: within a group, and for the rest, the usual order.
    rank = {name: position for position, (name, _) in enumerate(SERIAL_GROUPS)}
    items.sort(key=lambda item: rank.get(_group_of(item), len(rank)))


def _group_of(item) -> str | None:
    return next((name for name, belongs in SERIAL_GROUPS if belongs(item)), None)


def pytest_itemcollected(item):
    # Marked as each test is collected, before xdist reads the marks (in its pytest_collection_modifyitems).
    group = _group_of(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))
