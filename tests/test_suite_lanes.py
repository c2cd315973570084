"""The suite's own machinery (scripts/run_suite.py, tests/background.py, tests/conftest.py): the two lanes get
every test once, gates reach the other lane's process, and a process a test leaves behind is named."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_rlhf.utils.imports import import_target

from tests import background
from tests import conftest as suite_conftest

REPO = Path(__file__).resolve().parents[1]


def load_run_suite():
    return import_target(str(REPO / "scripts" / "run_suite.py"), "")


class FakeItem:
    def __init__(self, *fixtures: str, marks: tuple[str, ...] = (), nodeid: str = "tests/test_x.py::test_x"):
        self.fixturenames = list(fixtures)
        self.marks = set(marks)
        self.nodeid = nodeid

    def add_marker(self, mark):
        self.marks.add(mark.name)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_tests_that_wait_for_a_shared_model_are_marked_for_their_lane_and_ordered_by_what_they_wait_for():
    plain, cluster = FakeItem("tmp_path"), FakeItem("cluster", marks=("cluster",))
    from_random = FakeItem("world", marks=("learning",))
    on_base, on_reward = FakeItem("sft_base", marks=("learning",)), FakeItem("sft_base", "ppo_reward_model",
                                                                             marks=("learning",))
    # vLLM tests first, by marker or by name, but not among the learning tests
    engine, named = FakeItem("tmp_path", marks=("vllm",)), FakeItem("tmp_path", nodeid="tests/rl/t.py::test_on_vllm")
    vllm_on_base = FakeItem("sft_base", marks=("learning",), nodeid="tests/rl/test_ppo_vllm.py::test_learns")
    # files either lane runs: last, in EITHER_LANE's order, a learning test or one named for vLLM among them too
    first, last = suite_conftest.EITHER_LANE[0], suite_conftest.EITHER_LANE[-1]
    either_late = FakeItem("tmp_path", nodeid=f"{last}::test_a_failure")
    either_early = FakeItem("world", marks=("learning",), nodeid=f"{first}::test_on_vllm")
    items = [cluster, either_late, on_reward, on_base, either_early, vllm_on_base, from_random, plain, named, engine]
    suite_conftest.pytest_collection_modifyitems(None, None, items)
    assert items == [named, engine, plain, from_random, on_base, vllm_on_base, on_reward, cluster, either_early,
                     either_late]
    assert [("learning_lane" in i.marks) for i in items] == [False] * 4 + [True] * 3 + [False] * 3
    assert [("either_lane" in i.marks) for i in items] == [False] * 8 + [True] * 2
    assert load_run_suite().LANES == {"learning": ["-m", "learning_lane or either_lane"],
                                      "rest": ["-m", "not learning_lane"]}
    assert all((REPO / path).is_file() for path in suite_conftest.EITHER_LANE)


def another_lane(gates: Path) -> dict[str, str]:
    """The environment of a pytest process beside this one, sharing `gates`, with no timeline (in the suite, this
    lane's own)."""
    env = {k: v for k, v in os.environ.items() if k != "HPC_RLHF_TEST_TIMELINE"}
    return dict(env, HPC_RLHF_TEST_GATES=str(gates), OMP_NUM_THREADS="1")


def test_the_first_process_to_claim_a_name_gets_it_and_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "_CLAIMS", {})
    monkeypatch.setattr(background, "GATES_FOLDER", None)
    monkeypatch.delenv("HPC_RLHF_TEST_TIMELINE", raising=False)  # the suite's lane: its timeline is not for these
    assert background.claim("tests/a.py")  # alone: every claim is this process's
    monkeypatch.setattr(background, "GATES_FOLDER", str(tmp_path))
    other = subprocess.run([sys.executable, "-c", "from tests import background as b; "
                            "print(b.claim('tests/a.py'), b.claim('tests/a.py'))"], cwd=REPO, capture_output=True,
                           text=True, env=another_lane(tmp_path), check=True)
    assert other.stdout.split() == ["True", "True"]  # the other lane asked first
    assert not background.claim("tests/a.py") and not background.claim("tests/a.py")
    assert background.claim("tests/dir/b.py") and background.claim("tests/dir/b.py")
    assert sorted(p.name for p in (tmp_path / "claims").iterdir()) == ["tests__a.py", "tests__dir__b.py"]


def test_a_lane_passes_over_the_files_the_other_lane_claimed(tmp_path):
    """A lane of the suite, with the other lane holding one of EITHER_LANE's files: that file's tests are neither
    run nor reported, and the tests after it set up as usual (pytest asserts that what the last test run left set up
    is torn down to what the next one shares: here the package tests/launch, which the passed-over file shares with
    the test before it and the test after it does not)."""
    before, claimed, after = "tests/launch/test_local.py", "tests/launch/test_sbatch_scripts.py", "tests/test_chat.py"
    order = suite_conftest.EITHER_LANE
    assert order.index(before) < order.index(claimed) < order.index(after) == len(order) - 1
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / claimed.replace("/", "__")).write_text("1\n")
    lane = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           f"{after}::test_chat_names_a_folder_it_cannot_use[not a model]", claimed,
                           f"{before}::test_a_config_error_during_the_run_is_one_line_and_code_2"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=another_lane(tmp_path))
    assert lane.returncode == 0, lane.stdout[-3000:]
    passed = [line.split()[1].split("::")[0] for line in lane.stdout.splitlines() if line.startswith("PASSED ")]
    assert passed[0] == before and set(passed[1:]) == {after}, passed
    assert sorted(p.name for p in (tmp_path / "claims").iterdir()) == sorted(
        name.replace("/", "__") for name in (before, claimed, after))


def test_a_gate_opened_in_another_process_opens_here_through_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "GATES_FOLDER", str(tmp_path))
    monkeypatch.setattr(background, "_GATES", {})
    passed = threading.Event()
    waiter = threading.Thread(target=lambda: (background.wait_at_gate("g"), passed.set()), daemon=True)
    waiter.start()
    assert not passed.wait(1.5)  # closed: no file yet
    subprocess.run([sys.executable, "-c", f"import pathlib; pathlib.Path({str(tmp_path / 'g')!r}).touch()"],
                   check=True)  # the other lane opens it
    assert passed.wait(5)
    background.open_gate("h")  # and what this process opens, the others see
    assert (tmp_path / "h").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_left_holding_a_lanes_output_is_named():
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        time.sleep(0.2)
        named = load_run_suite()._holders(holder.stdout.fileno())
        assert any(line.startswith(f"{holder.pid}: ") and "time.sleep(30)" in line for line in named), named
        assert not any(line.startswith(f"{os.getpid()}: ") for line in named)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()



def test_a_lanes_failed_tests_are_repeated_with_its_summary_at_the_end():
    log = "\n".join(["tests/a.py ..F", "=== short test summary info ===",
                     "FAILED tests/a.py::test_x - AssertionError: " + "y" * 500, "ERROR tests/b.py::test_z - boom",
                     "1 failed, 2 passed, 1 error in 3.00s", ""])
    report = load_run_suite().lane_report("rest", 1, log)
    assert report[0].startswith("lane rest: FAILED tests/a.py::test_x - AssertionError: y")
    assert len(report[0]) == len("lane rest: ") + load_run_suite().MAX_FAILURE_LINE
    assert report[1:] == ["lane rest: ERROR tests/b.py::test_z - boom",
                          "lane rest: exit 1: 1 failed, 2 passed, 1 error in 3.00s"]
    assert load_run_suite().lane_report("learning", 0, "") == ["lane learning: exit 0: (no output)"]


def test_every_test_folder_is_collected(pytestconfig):
    """No folder of tests/ matches a pattern pytest skips when it walks `tests` (its default `norecursedirs` had
    "dist", and tests/dist went unrun until pyproject.toml listed the patterns without it)."""
    import fnmatch

    skipped = pytestconfig.getini("norecursedirs")
    folders = [p for p in Path(__file__).parent.rglob("*") if p.is_dir() and "__pycache__" not in p.parts]
    hidden = [str(f) for f in folders if any(fnmatch.fnmatch(f.name, pattern) for pattern in skipped)]
    assert not hidden, f"pytest would not collect {hidden} (norecursedirs {skipped})"


def test_a_lanes_environment_writes_bytecode_and_names_its_gates_and_timeline(tmp_path):
    run_suite = load_run_suite()
    env = run_suite.lane_environment({"PYTHONDONTWRITEBYTECODE": "1", "HOME": "/h"}, tmp_path, "rest")
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["HOME"] == "/h" and env["PYTHONUNBUFFERED"] == "1"
    assert env["HPC_RLHF_TEST_GATES"] == str(tmp_path / "gates")
    assert env["HPC_RLHF_TEST_TIMELINE"] == str(tmp_path / "rest.timeline")
