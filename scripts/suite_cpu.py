"""Where a suite run's CPU time went, from the kernel's process accounting: every process that ended, with its
parent, included (the lanes' timelines count only what their own processes reaped).

    touch /tmp/suite.acct && accton /tmp/suite.acct      # root; Debian's `acct` package
    make test; sleep 5; accton off                          # the lanes' zygotes end a second after their pytest
    python scripts/suite_cpu.py /tmp/suite.acct /tmp/hpc_rlhf_suite_XXXX

Prints the whole run's CPU-seconds, then for each lane (its pytest process is found by its command line's
timeline) the CPU of each test file and of each background job of the lane, counting every descendant of the
processes a test started (by start time, within its span; a background job's by its end); then what ran outside the lanes' process trees (the
local Slurm's job steps, and vLLM processes whose driving rank had died), and how many interpreters paid the
imports (python processes started afresh, not forked from another, of at least IMPORTING_CPU_S). `dump-acct` (from the
same package) reads the file.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_suite import read_timeline  # noqa: E402  (the lanes' timelines, as the suite writes them)

IMPORTING_CPU_S = 3.5  # a python process that spent this much paid for torch's, transformers' and deepspeed's imports
LANES = ("learning", "rest")


@dataclass
class Process:
    pid: int
    ppid: int
    command: str
    cpu_s: float
    wall_s: float
    start: float
    children: list[int] = field(default_factory=list)
    forked: bool = False  # forked and never exec'd (the kernel's AFORK flag): a zygote's run, a rank of a fork


def read_accounting(path: str) -> dict[int, Process]:
    """Every process of a process-accounting file (`dump-acct`: command, utime, stime, elapsed in clock ticks, the
    flags, F for a process that forked and did not exec)."""
    text = subprocess.run(["dump-acct", path], capture_output=True, text=True, check=True).stdout
    ticks = 100.0  # dump-acct prints times in units of 1/AHZ = 1/100 s
    procs: dict[int, Process] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        start = time.mktime(time.strptime(cells[-1], "%a %b %d %H:%M:%S %Y"))
        procs[int(cells[9])] = Process(int(cells[9]), int(cells[10]), cells[0],
                                       (float(cells[2]) + float(cells[3])) / ticks, float(cells[4]) / ticks, start,
                                       forked="F" in cells[11])
    for proc in procs.values():
        if proc.ppid in procs:
            procs[proc.ppid].children.append(proc.pid)
    return procs


def subtree(procs: dict[int, Process], pid: int) -> list[Process]:
    found, todo = [], [pid]
    while todo:
        proc = procs[todo.pop()]
        found.append(proc)
        todo.extend(proc.children)
    return found


def lane_processes(procs: dict[int, Process], suite: Path) -> dict[str, int]:
    """The pytest process of each lane: from `<lane>.pid` (scripts/run_suite.py writes it), else the python
    processes under the suite's runner that lived as long as the lanes, the learning lane being the one whose
    children ended when more of the background jobs of its timeline did."""
    found = {lane: int((suite / f"{lane}.pid").read_text()) for lane in LANES if (suite / f"{lane}.pid").is_file()}
    if found:
        return {lane: pid for lane, pid in found.items() if pid in procs}
    spans = {lane: read_timeline(suite / f"{lane}.timeline") for lane in LANES}
    every = [s for lane in LANES for s in spans[lane]]
    if not every:
        return {}
    first = min(s[0] for s in every)
    shorter = min(max(s[1] for s in spans[lane]) for lane in LANES if spans[lane])  # the lane that ended first
    lived = {p.pid for p in procs.values() if p.command == "python" and p.start <= first + 1
             and p.start + p.wall_s >= shorter - 1 and p.children}
    lanes = [pid for pid in lived if not any(c in lived for c in procs[pid].children)]
    ends = [e for b, e, w, _ in spans["learning"] if w.startswith("background ")]

    def background_jobs_ended(pid: int) -> int:
        return sum(any(abs(e - (procs[c].start + procs[c].wall_s)) < 3 for c in procs[pid].children) for e in ends)

    if len(lanes) != 2 or background_jobs_ended(lanes[0]) == background_jobs_ended(lanes[1]):
        return {}
    learning, rest = sorted(lanes, key=background_jobs_ended, reverse=True)
    return {"learning": learning, "rest": rest}


def during_the_suite(procs: dict[int, Process], lanes: dict[str, int]) -> dict[int, Process]:
    """The processes that started with the lanes or after them (not those of `make venv` before them, say)."""
    if not lanes:
        return procs
    first = min(procs[pid].start for pid in lanes.values()) - 2  # the accounting's start times are whole seconds
    kept = {pid: p for pid, p in procs.items() if p.start >= first}
    for proc in kept.values():
        proc.children = [c for c in proc.children if c in kept]
    return kept


def report(procs: dict[int, Process], suite: Path) -> str:
    lanes = lane_processes(procs, suite)
    procs = during_the_suite(procs, lanes)
    lines = [f"the suite: {sum(p.cpu_s for p in procs.values()):.0f} CPU-s in {len(procs)} processes"]
    inside: set[int] = set()
    for lane, pid in lanes.items():
        spans = read_timeline(suite / f"{lane}.timeline")
        tests = sorted(s for s in spans if not s[2].startswith("background "))
        background = [s for s in spans if s[2].startswith("background ")]
        by_what: dict[str, float] = collections.defaultdict(float)
        todo = list(procs[pid].children)
        while todo:
            proc = procs[todo.pop()]
            # A background job is marked from when it was asked for (it may wait for another): matched by its end.
            what = next((w for b, e, w, _ in background if abs(e - (proc.start + proc.wall_s)) < 3), None)
            running = [(w.split("::")[0], e) for b, e, w, _ in tests if b - 1 <= proc.start <= e + 1]
            if what is None and proc.children and running and proc.start + proc.wall_s > running[-1][1] + 3:
                # A server that outlived the test that started it (a zygote the tests' command lines fork from,
                # tests/cli_zygote.py): its children are counted each by when it started.
                inside.add(proc.pid)
                by_what["(servers of the tests: their own CPU)"] += proc.cpu_s
                todo.extend(proc.children)
                continue
            if what is None:
                what = running[-1][0] if running else "(between tests)"
            tree = subtree(procs, proc.pid)
            inside.update(p.pid for p in tree)
            by_what[what] += sum(p.cpu_s for p in tree)
        inside.add(pid)
        lines.append(f"lane {lane}: pytest {procs[pid].cpu_s:.0f} CPU-s, its children {sum(by_what.values()):.0f}")
        for what, cpu in sorted(by_what.items(), key=lambda item: -item[1]):
            if cpu >= 5:
                lines.append(f"  {cpu:7.1f}  {what}")
    outside = [p for p in procs.values() if p.pid not in inside]
    by_command: dict[str, float] = collections.defaultdict(float)
    for proc in outside:
        by_command[proc.command] += proc.cpu_s
    lines.append(f"outside the lanes: {sum(by_command.values()):.0f} CPU-s: " +
                 ", ".join(f"{c} {s:.0f}" for c, s in sorted(by_command.items(), key=lambda i: -i[1])[:6]))
    busy = [p for p in procs.values() if p.command == "python" and p.cpu_s >= IMPORTING_CPU_S]
    fresh, forked = [p for p in busy if not p.forked], [p for p in busy if p.forked]
    lines.append(f"python processes of >= {IMPORTING_CPU_S} CPU-s: {len(fresh)} started afresh (each paid the "
                 f"imports), {sum(p.cpu_s for p in fresh):.0f} CPU-s; {len(forked)} forked, "
                 f"{sum(p.cpu_s for p in forked):.0f} CPU-s")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(report(read_accounting(sys.argv[1]), Path(sys.argv[2])))
