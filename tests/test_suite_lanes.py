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
    # a file of the learning lane's tail: after the learning tests, in that lane
    tail = FakeItem("tmp_path", nodeid=f"{suite_conftest.LEARNING_LANE_TAIL[0]}::test_a_failure")
    items = [cluster, tail, on_reward, on_base, vllm_on_base, from_random, plain, named, engine]
    suite_conftest.pytest_collection_modifyitems(None, None, items)
    assert items == [named, engine, plain, from_random, on_base, vllm_on_base, on_reward, tail, cluster]
    assert [("learning_lane" in i.marks) for i in items] == [False, False, False, False, True, True, True, True,
                                                              False]
    assert load_run_suite().LANES == {"learning": ["-m", "learning_lane"], "rest": ["-m", "not learning_lane"]}
    assert all((REPO / path).is_file() for path in suite_conftest.LEARNING_LANE_TAIL)


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
