import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hpc_rlhf  # noqa: E402,F401  (pins the CPU kernels before torch loads: utils/cpu_kernels.py)
import torch  # noqa: E402

from tests import background  # noqa: E402

torch.set_num_threads(1)


# The shared models that take longest (tests/trainers/conftest.py): the SFT base, and the reward model after it.
LATE_SHARED_MODELS = {"sft_base", "ppo_reward_model"}


def pytest_collection_modifyitems(session, config, items):
    """Tests that wait for work started in the background run last: the learning tests (they need the shared
    models), then the cluster tests (they need the local Slurm's jobs). Among the learning tests, those that need
    none of the late shared models go first: they run beside the reward model's training instead of after it,
    where one of the two cores would be idle. Otherwise the collected order stays."""
    items.sort(key=lambda item: (item.get_closest_marker("cluster") is not None,
                                 item.get_closest_marker("learning") is not None,
                                 bool(LATE_SHARED_MODELS & set(item.fixturenames))))  # a stable sort


def pytest_collection_finish(session):
    """Start, as soon as the session knows its tests, the slow shared work they need (tests/background.py)."""
    if session.config.option.collectonly or not session.items:
        return
    needed = {name for item in session.items for name in item.fixturenames}
    factory = session.config._tmp_path_factory  # what the tmp_path_factory fixture hands out
    from tests.trainers.conftest import start_shared_models

    start_shared_models(factory, needed)
    if "cluster" in needed:
        from tests.cluster.conftest import start_cluster_session

        if not background.started("sft_base"):  # the gate opens when the SFT base is trained (background.py)
            background.open_gate(background.CLUSTER_JOBS_GATE)
        start_cluster_session(factory, needed)


def pytest_runtest_setup(item):
    """A cluster test needs the cluster's jobs now, whatever else is still training (tests/background.py)."""
    if item.get_closest_marker("cluster"):
        background.open_gate(background.CLUSTER_JOBS_GATE)
