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

# Test files the learning lane runs after its learning tests (scripts/run_suite.py): without them the rest lane ran
# 8 minutes longer, alone on the machine with a core idle (fresh-clone suite of 2026-11-27, AMD EPYC: learning lane
# 24m03s, rest lane 32m10s; these files took about 4.5 minutes of the rest lane). Self-contained runs of their own.
# With the dry run free of torch the sbatch scripts' tests shrank from ~3 minutes to seconds, and the rest lane
# ended 2 minutes after the learning lane (4b395d7: 25m58s against 24m01s): the entry points' tests went along.
# With the local Slurm's ranks forked (4979c9f) the rest lane ended 4.5 minutes before the learning lane (36m52s
# against 41m33s, a slow VM), the learning lane alone on the machine after it: the watchdog's tests (1.6 minutes
# there) went back. With the 2-layer tiny Llama (d5632be) the learning lane ended first again (35m39s against
# 39m33s): the simulator's tests (1.5 minutes of the rest lane, one process, no timing in them) went along.
# With them the rest lane ended last again, by 5.8 minutes, alone on the machine (8879c38, 2026-11-29: learning
# 34m39s, rest 40m27s): the zygotes', the reproducibility and the chat tests (2.5 minutes there, its last files)
# went along (ff80c09, the same VM: learning 37m53s, rest 36m26s). The reward model scoring each pair in one row
# and cheaper tests of the learning lane's tail (2026-11-29) took ~270 CPU-seconds from the learning lane and none
# from the rest lane; the learning lane still ended last, with the bootstrap's tests moved along (a955db4: learning
# 30m03s, rest 28m21s; the bootstrap's tests 45 s of it): they went back. With the tests' forked runs ending without
# the interpreter's teardown (c0da0a3: ~3 CPU-seconds a run, most of them in the rest lane) the learning lane ended
# last by 3 minutes (learning 28m27s, rest 25m29s): the zygotes' own tests (73 s there) went back.
LEARNING_LANE_TAIL = ("tests/trainers/test_failures.py", "tests/launch/test_sbatch_scripts.py",
                      "tests/launch/test_local.py", "tests/dist/test_store_host.py",
                      "tests/launch/test_entry_points.py", "tests/scale/test_simulate.py",
                      "tests/trainers/test_reproducibility.py", "tests/test_chat.py")


def _in_the_learning_lanes_tail(item) -> bool:
    return item.nodeid.split("::", 1)[0] in LEARNING_LANE_TAIL


def _runs_vllm(item) -> bool:
    """Whether a test starts vLLM's engine or belongs with those that do (marker `vllm`, or vLLM in its name)."""
    return item.get_closest_marker("vllm") is not None or "vllm" in item.nodeid.lower()


def _waits_for(item) -> int:
    """How far down the shared models' chain a test waits: 0 for none, 1 for the SFT base, 2 for the reward model."""
    return max((i + 1 for i, name in enumerate(SHARED_MODELS) if name in item.fixturenames), default=0)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the learning_lane marker is set here
def pytest_collection_modifyitems(session, config, items):
    """Tests that wait for work started in the background run last: the learning tests (they need the shared
    models), then the cluster tests (they need the local Slurm's jobs). Among the learning tests, those that need
    no shared model go first, then those that need the SFT base, then those that need the reward model: none waits
    for a model while a test that could run is left for later. The files of LEARNING_LANE_TAIL come after the
    learning tests. Otherwise the collected order stays.

    A test that waits for a shared model, or is in LEARNING_LANE_TAIL, is marked `learning_lane`
    (scripts/run_suite.py runs those in a lane of their own)."""
    for item in items:
        if _waits_for(item) or _in_the_learning_lanes_tail(item):
            item.add_marker(pytest.mark.learning_lane)
    items.sort(key=lambda item: (item.get_closest_marker("cluster") is not None, _in_the_learning_lanes_tail(item),
                                 item.get_closest_marker("learning") is not None, _waits_for(item),
                                 not (_runs_vllm(item) and not item.get_closest_marker("learning"))))  # stable


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
