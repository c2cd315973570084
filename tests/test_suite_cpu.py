"""scripts/suite_cpu.py: a suite run's CPU by lane, test file and background job, from process accounting."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import suite_cpu  # noqa: E402
from suite_cpu import Process  # noqa: E402


def timeline(path: Path, *events: tuple[float, str, str]) -> None:
    path.write_text("".join(f"{stamp:.1f} {event} {what}\t0.0\n" for stamp, event, what in events))


def accounting(*rows: tuple, forked: tuple[int, ...] = ()) -> dict[int, Process]:
    """(pid, ppid, command, cpu, wall, start) per process; `forked`: the pids that forked and did not exec."""
    procs = {pid: Process(pid, ppid, command, cpu, wall, start, forked=pid in forked)
             for pid, ppid, command, cpu, wall, start in rows}
    for proc in procs.values():
        if proc.ppid in procs:
            procs[proc.ppid].children.append(proc.pid)
    return procs


def test_each_test_file_gets_the_cpu_of_every_descendant_and_a_background_job_is_found_by_its_end(tmp_path):
    timeline(tmp_path / "learning.timeline",
             (1000.0, "start", "background sft_base"), (1002.0, "start", "tests/rl/test_a.py::one"),
             (1040.0, "end", "tests/rl/test_a.py::one"), (1041.0, "start", "tests/rl/test_b.py::two"),
             (1090.0, "end", "tests/rl/test_b.py::two"), (1080.0, "end", "background sft_base"))
    timeline(tmp_path / "rest.timeline", (1001.0, "start", "tests/test_c.py::three"),
             (1095.0, "end", "tests/test_c.py::three"))
    procs = accounting(
        (5, 1, "pip", 50.0, 10.0, 900.0),  # make venv, before the suite: not counted
        (9, 1, "python", 1.0, 100.0, 999.0),  # the suite runner
        (10, 9, "python", 20.0, 98.0, 999.0), (30, 9, "python", 8.0, 97.0, 999.0),  # the two lanes
        (11, 10, "python", 6.0, 80.0, 1000.0),  # the background job (ends at 1080)
        (12, 10, "python", 5.0, 30.0, 1005.0), (13, 12, "python", 7.0, 29.0, 1005.0),  # test_a and a rank of it
        (14, 10, "python", 4.0, 5.0, 1050.0),  # test_b
        (31, 30, "python", 2.0, 5.0, 1010.0),  # test_c
        (40, 1, "slurmstepd", 3.0, 20.0, 1020.0),  # outside the lanes
        forked=(13,))  # test_a's rank, forked from its launcher
    text = suite_cpu.report(procs, tmp_path)  # the lanes found from the timelines
    (tmp_path / "learning.pid").write_text("10")
    (tmp_path / "rest.pid").write_text("30")
    assert suite_cpu.report(procs, tmp_path) == text  # and from run_suite's pid files
    assert text.splitlines()[0] == "the suite: 56 CPU-s in 9 processes"
    assert "lane learning: pytest 20 CPU-s, its children 22" in text
    assert "     12.0  tests/rl/test_a.py" in text and "      6.0  background sft_base" in text
    assert "test_b" not in text  # under 5 CPU-s
    assert "lane rest: pytest 8 CPU-s, its children 2" in text
    assert "outside the lanes: 4 CPU-s: slurmstepd 3, python 1" in text
    assert "python processes of >= 3.5 CPU-s: 5 started afresh (each paid the imports), 43 CPU-s; 1 forked, 7 CPU-s" \
        in text


def test_the_runs_a_zygote_forks_are_counted_by_when_each_started(tmp_path):
    timeline(tmp_path / "rest.timeline",
             (1000.0, "start", "tests/test_a.py::one"), (1020.0, "end", "tests/test_a.py::one"),
             (1021.0, "start", "tests/test_b.py::two"), (1090.0, "end", "tests/test_b.py::two"))
    timeline(tmp_path / "learning.timeline")
    (tmp_path / "rest.pid").write_text("30")
    procs = accounting(
        (30, 1, "python", 8.0, 97.0, 999.0),  # the lane
        (31, 30, "python", 2.0, 95.0, 1002.0),  # a zygote, started by test_a's first command line: lives on
        (32, 31, "python", 0.0, 10.0, 1003.0), (33, 32, "python", 6.0, 10.0, 1003.0),  # test_a's run
        (34, 31, "python", 0.0, 30.0, 1030.0), (35, 34, "python", 9.0, 30.0, 1030.0))  # test_b's run
    text = suite_cpu.report(procs, tmp_path)
    assert "lane rest: pytest 8 CPU-s, its children 17" in text
    assert "      9.0  tests/test_b.py" in text and "      6.0  tests/test_a.py" in text
    assert "outside the lanes: 0 CPU-s" in text
