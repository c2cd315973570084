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
# (one at a time: their bounds are measured from the fault to the job's end).
SERIAL_GROUPS = (("cluster", lambda item: item.nodeid.startswith("tests/cluster/")),
                 ("sft_base", lambda item: "sft_base" in item.fixturenames),
                 ("lost_ranks", lambda item: item.nodeid.startswith("tests/trainers/test_failures.py")))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups from the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = next((name for name, belongs in SERIAL_GROUPS if belongs(item)), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
