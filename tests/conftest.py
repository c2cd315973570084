import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hpc_rlhf  # noqa: E402,F401  (pins the CPU kernels before torch loads: utils/cpu_kernels.py)
import pytest  # noqa: E402
import torch  # noqa: E402

from tests import background  # noqa: E402
from tests.ci_skips import pytest_configure, pytest_runtest_makereport  # noqa: E402,F401  (hooks: CI fails on skips)
from tests.ci_skips import pytest_runtest_setup as _cuda_only  # noqa: E402
from tests.recipes import grpo_teacher, ppo_reward_model, sft_base, tool_sft_base, world  # noqa: E402,F401  (fixtures)

torch.set_num_threads(1)


# The shared models in the order they are ready (tests/recipes.py): the SFT base, then the GRPO teacher (a short
# RL run), the reward model and the calculator's tool base, all trained from it.
SHARED_MODELS = ("sft_base", "grpo_teacher", "ppo_reward_model", "tool_sft_base")

# Test files either lane runs at its end, whichever reaches each first (tests/background.py `claim`): self-contained
# runs that need no shared model and no cluster. Since the lanes began (2026-11-27) a fixed list of files went after
# the learning tests to even out the lanes' lengths, and with every change of the suite, or of the VM's speed, one
# lane ended last again, alone on the machine with a core idle: by 8 minutes (2026-11-27, AMD EPYC), 5.8 (8879c38),
# 3 (c0da0a3), 1.5 (1c4c420, Intel Xeon), files moved between the lanes each time. Shared out as the lanes end, the
# lanes end within about the length of the last file taken (14 s apart in 7d42aaf's fresh clone). Longest first
# (wall seconds in the fresh-clone suites of 2026-11-30, Intel Xeon), so that what is left for the end is short.
EITHER_LANE = ("tests/dist/test_watchdog.py",                 # 57-88 s
               "tests/test_cli_zygote.py",                    # 65-70
               "tests/dist/test_bootstrap.py",                # 23-53
               "tests/launch/test_entry_points.py",           # 49-50
               "tests/trainers/test_failures.py",             # 37-46
               "tests/trainers/test_sft.py",                  # 37-38
               "tests/launch/test_local.py",                  # 25-31
               "tests/trainers/test_reproducibility.py",      # 21-29
               "tests/trainers/test_resume_on_another_size.py",  # 18-22
               "tests/dist/test_store_host.py",               # 18-20
               "tests/scale/test_simulate.py",                # 13-17
               "tests/launch/test_sbatch_scripts.py",         # 10-18
               "tests/test_chat.py")                          # 1-2


def _file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _either_lane(item) -> bool:
    return _file_of(item) in EITHER_LANE


def _runs_vllm(item) -> bool:
    """Whether a test starts vLLM's engine or belongs with those that do (marker `vllm`, or vLLM in its name), and
    runs with the vLLM tests at the start of its lane (not one of EITHER_LANE's files, which run at the end)."""
    return (item.get_closest_marker("vllm") is not None or "vllm" in item.nodeid.lower()) and not _either_lane(item)


def _waits_for(item) -> int:
    """How far down the shared models' chain a test waits: 0 for none, 1 for the SFT base, 2 for the reward model."""
    return max((i + 1 for i, name in enumerate(SHARED_MODELS) if name in item.fixturenames), default=0)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the lanes' markers are set here
def pytest_collection_modifyitems(session, config, items):
    """Tests that wait for work started in the background run late: the learning tests (they need the shared
    models), then the cluster tests (they need the local Slurm's jobs), then the files of EITHER_LANE in its order.
    Among the learning tests, those that need no shared model go first, then those that need the SFT base, then
    those that need the reward model: none waits for a model while a test that could run is left for later.
    Otherwise the collected order stays.

    A test that waits for a shared model is marked `learning_lane`, and one of EITHER_LANE's files `either_lane`
    (scripts/run_suite.py runs the first in a lane of their own, the second in both lanes: pytest_runtest_protocol)."""
    for item in items:
        if _either_lane(item):
            item.add_marker(pytest.mark.either_lane)
        elif _waits_for(item):
            item.add_marker(pytest.mark.learning_lane)
    items.sort(key=lambda item: (EITHER_LANE.index(_file_of(item)) + 1 if _either_lane(item) else 0,
                                 item.get_closest_marker("cluster") is not None,
                                 item.get_closest_marker("learning") is not None, _waits_for(item),
                                 not (_runs_vllm(item) and not item.get_closest_marker("learning"))))  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A file of EITHER_LANE runs in the lane that reaches it first (tests/background.py `claim`); the other lane
    passes over its tests: nothing set up, nothing reported (pytest counts them in the lane that ran them)."""
    if not _either_lane(item) or background.claim(_file_of(item)):
        return None  # pytest runs the test
    # What pytest does after each test it runs: tear down what the next test does not share (here, what the last
    # test this lane ran left set up; this file's fixtures were never set up).
    item.session._setupstate.teardown_exact(nextitem)
    return True


def pytest_collection_finish(session):
    """Start, as soon as the session knows its tests, the slow shared work they need (tests/background.py)."""
    if session.config.option.collectonly or not session.items:
        return
    needed = {name for item in session.items for name in item.fixturenames}
    factory = session.config._tmp_path_factory  # what the tmp_path_factory fixture hands out
    from tests.recipes import start_shared_models

    start_shared_models(factory, needed)
    if "cluster" in needed:
        from tests.cluster.conftest import start_cluster_session

        # The gate opens when the SFT base is trained (background.py): in this process, or in the other lane of
        # scripts/run_suite.py. With neither, it opens now; with the other lane but no SFT base trained there (its
        # tests deselected), the first cluster test opens it (pytest_runtest_setup).
        if not background.started("sft_base") and not background.gates_shared_with_other_processes():
            background.open_gate(background.CLUSTER_JOBS_GATE)
        start_cluster_session(factory, needed)
        vllm_items = [item.nodeid for item in session.items if _runs_vllm(item) and not item.get_closest_marker("cluster")]
        global _LAST_VLLM_TEST
        _LAST_VLLM_TEST = vllm_items[-1] if vllm_items else None
        if _LAST_VLLM_TEST is None:
            background.open_gate(background.VLLM_TESTS_GATE)


_LAST_VLLM_TEST: str | None = None  # in a session with cluster tests: its jobs wait until this test has run


def pytest_runtest_logstart(nodeid, location):
    """When each test starts and ends, in the lane's timeline (tests/background.py `mark`): the lanes' timelines
    side by side show which tests ran beside which, and beside which background work."""
    background.mark("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    background.mark("end", nodeid)
    if nodeid == _LAST_VLLM_TEST:
        background.open_gate(background.VLLM_TESTS_GATE)


def pytest_runtest_setup(item):
    """A cluster test needs the cluster's jobs now, whatever else is still training (tests/background.py); a test
    marked `cuda` is skipped without a CUDA GPU (tests/ci_skips.py)."""
    _cuda_only(item)
    if item.get_closest_marker("cluster"):
        background.open_gate(background.CLUSTER_JOBS_GATE)
        background.open_gate(background.VLLM_TESTS_GATE)
