"""The test suite in two pytest processes side by side (`make test` runs this).

    python scripts/run_suite.py [PYTEST ARGS...]        # e.g. -x, -k name; given to both lanes

Lane `learning`: the tests that wait for the shared models (the SFT base and the reward model after it, trained
in the background: tests/recipes.py), that is most learning tests, which then run one after the other, mostly one
process on one core each. Lane `rest`: every other test, the cluster tests last (they wait for the local Slurm's
jobs, which go in when the learning lane's SFT base is trained: a gate shared through a folder, tests/background.py).
Then both lanes end with the files of tests/conftest.py's EITHER_LANE, each run by the lane that reaches it first (a
claim through the same folder), so that the lanes end at about the same time whichever would have been the longer.
In one pytest process the learning tests waited behind the others and then ran alone, a core idle about half of
the last third of the suite.

Each lane's lines are printed as they come, prefixed with the lane's name; at the end, each lane's failed tests
(pytest's FAILED and ERROR lines) and its pytest summary. The exit
status is the worse of the two (a lane that collects nothing, because the arguments deselect all of it, counts as
passed). A process a test left running would hold its lane's output open after pytest has exited: the suite waits
OUTPUT_GRACE_S for the output to end, then names such processes (pid and command line) and ends without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LANES = {"learning": ["-m", "learning_lane or either_lane"], "rest": ["-m", "not learning_lane"]}
NO_TESTS_COLLECTED = 5  # pytest's exit code
OUTPUT_GRACE_S = 10.0
MAX_FAILURE_LINE = 300


def _holders(pipe_fd: int) -> list[str]:
    """'pid: command line' of every other process with this pipe open (for the write end, as a lane's children
    inherit it)."""
    wanted = f"pipe:[{os.fstat(pipe_fd).st_ino}]"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == wanted for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {command[:200]}")
        except OSError:
            continue
    return found


def _pipe(name: str, stream, log: Path, lock: threading.Lock) -> None:
    with open(log, "w") as out:
        for line in stream:
            out.write(line)
            out.flush()  # read back for the summary even when a process left behind keeps the stream open
            with lock:
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()


def read_timeline(path: Path) -> list[tuple[float, float, str, float]]:
    """(start, end, what, CPU-seconds) of every test and background job of a lane's timeline (tests/background.py
    `mark`; a background job's CPU there is that of everything its lane did meanwhile, so it is given as 0)."""
    began, spans = {}, []
    if not path.is_file():
        return spans
    for line in path.read_text().splitlines():
        line, _, cpu = line.partition("\t")
        stamp, event, what = line.split(" ", 2)
        if event == "start":
            began[what] = (float(stamp), float(cpu or 0))
        elif event == "end" and what in began:
            (begin, cpu_begin), background = began.pop(what), what.startswith("background ")
            spans.append((begin, float(stamp), what, 0.0 if background else float(cpu or 0) - cpu_begin))
    return spans


def print_timeline(root: Path, start_wall: float, slowest: int = 12) -> None:
    """The slowest tests and background jobs of both lanes, each with when it ran (minutes into the suite) and
    what the other lane was running then: where two heavy things met, the suite lost time."""
    spans = {name: read_timeline(root / f"{name}.timeline") for name in LANES}
    rows = sorted(((end - begin, name, begin, end, what, cpu) for name, lane in spans.items()
                   for begin, end, what, cpu in lane), reverse=True)[:slowest]
    if not rows:
        return
    print(f"slowest of both lanes, wall and CPU seconds (timelines in {root}):")
    for took, name, begin, end, what, cpu in rows:
        beside = [w for other, lane in spans.items() if other != name for b, e, w, _ in lane
                  if b < end and e > begin and e - b > 20]
        print(f"  {took:6.0f} s {cpu:6.0f} cpu  {(begin - start_wall) / 60:5.1f}-{(end - start_wall) / 60:5.1f} min  "
              f"[{name}] {what}" + (f"\n{'':41}beside: {', '.join(sorted(beside, key=len)[:4])}" if beside else ""))


class BusySampler:
    """The machine's CPU use while the suite runs (/proc/stat every SAMPLE_S seconds): where it fell well below
    all cores, a core waited (a test sleeping on a timeout, a lane waiting at a gate) and the lanes could be
    scheduled tighter."""
    SAMPLE_S = 5.0

    def __init__(self):
        self.samples: list[tuple[float, float]] = []  # (seconds into the suite, busy cores)
        self.stop = threading.Event()
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _cpu_times() -> tuple[float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def _run(self) -> None:
        last = self._cpu_times()
        while not self.stop.wait(self.SAMPLE_S):
            now = self._cpu_times()
            if last is not None and now is not None and now[1] > last[1]:
                share = (now[0] - last[0]) / (now[1] - last[1])
                self.samples.append((time.monotonic() - self.start, share * (os.cpu_count() or 1)))
            last = now

    def report(self) -> str:
        self.stop.set()
        self.thread.join(self.SAMPLE_S + 1)
        if not self.samples:
            return "machine CPU use: not sampled (no /proc/stat)"
        cores = os.cpu_count() or 1
        mean = sum(busy for _, busy in self.samples) / len(self.samples)
        low = [at for at, busy in self.samples if busy < 0.75 * cores]
        spans, begin = [], None
        for i, at in enumerate(low):  # consecutive low samples as spans of minutes
            begin = at if begin is None else begin
            if i + 1 == len(low) or low[i + 1] - at > 1.5 * self.SAMPLE_S:
                spans.append(f"{(begin - self.SAMPLE_S) / 60:.1f}-{at / 60:.1f}")
                begin = None
        return (f"machine CPU use: {mean:.2f} of {cores} cores on average; under {0.75 * cores:.1f} for "
                f"{len(low) * self.SAMPLE_S / 60:.1f} min" + (f" (minutes {', '.join(spans[:12])})" if spans else ""))


def lane_report(name: str, code: int, log: str) -> list[str]:
    """A lane's last lines: its failed tests (pytest's FAILED and ERROR lines, cut to MAX_FAILURE_LINE characters),
    repeated at the end where a reader of only the output's tail (CI's) finds them, then its pytest summary."""
    lines = log.rstrip().splitlines()
    failed = [f"lane {name}: {line[:MAX_FAILURE_LINE]}" for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return [*failed, f"lane {name}: exit {code}: {(lines[-1:] or ['(no output)'])[0]}"]


def lane_environment(base, root: Path, name: str) -> dict[str, str]:
    """A lane's pytest environment: `base`, unbuffered, with the suite's gates and the lane's timeline. Bytecode is
    written (__pycache__/, ignored by git) even where the shell says not to: with PYTHONDONTWRITEBYTECODE=1 each lane
    rewrote and compiled every test module it collected (18 CPU-seconds of collection against 11, 2026-11-29), and
    every fresh interpreter of the suite compiled the package's modules."""
    env = dict(base, PYTHONUNBUFFERED="1", HPC_RLHF_TEST_GATES=str(root / "gates"),
               HPC_RLHF_TEST_TIMELINE=str(root / f"{name}.timeline"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def main(argv: list[str]) -> int:
    # The built-in assets, once, before two processes would each find them missing and write them.
    subprocess.run([sys.executable, "-m", "hpc_rlhf", "assets"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    start, start_wall = time.monotonic(), time.time()
    busy = BusySampler()
    lock = threading.Lock()
    root = Path(tempfile.mkdtemp(prefix="hpc_rlhf_suite_"))
    (root / "gates").mkdir()
    base = dict(os.environ)
    # The children that multiprocessing spawns in both lanes' runs (vLLM's engine cores) fork from one zygote, which
    # imports at the first of them (tests/distributed.py `spawn_python`): once for the suite, not once per lane.
    sys.path.insert(0, str(REPO))
    from tests.distributed import FRESH_VAR, SPAWN_PYTHON_VAR, start_spawn_zygote

    _, spawn_python = start_spawn_zygote() if base.get(FRESH_VAR) != "1" else (None, None)
    if spawn_python:
        base[SPAWN_PYTHON_VAR] = spawn_python
    procs, threads = {}, []
    for name, selection in LANES.items():
        cmd = [sys.executable, "-m", "pytest", "-q", "--durations=15", f"--basetemp={root / name}", *selection,
               *argv, "tests"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=lane_environment(base, root, name))
        (root / f"{name}.pid").write_text(str(proc.pid))  # for scripts/suite_cpu.py
        thread = threading.Thread(target=_pipe, args=(name, proc.stdout, root / f"{name}.log", lock), daemon=True)
        thread.start()
        procs[name], threads = proc, [*threads, thread]
    codes = {name: proc.wait() for name, proc in procs.items()}
    for (name, proc), thread in zip(procs.items(), threads):
        thread.join(OUTPUT_GRACE_S)
        if thread.is_alive():
            left = _holders(proc.stdout.fileno())
            print(f"lane {name}: pytest has exited, but {len(left)} processes still hold its output (left running "
                  f"by a test; not waited for):", *left, sep="\n  ")
    elapsed = time.monotonic() - start
    print_timeline(root, start_wall)
    print(busy.report())
    for name, code in codes.items():
        print(*lane_report(name, code, (root / f"{name}.log").read_text()), sep="\n")
    minutes, seconds = divmod(round(elapsed), 60)
    print(f"suite: {minutes}m{seconds:02d}s in two lanes (logs in {root})")
    worst = max((0 if code == NO_TESTS_COLLECTED else code) for code in codes.values())
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
