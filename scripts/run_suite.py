"""The test suite in two pytest processes side by side (`make test` runs this).

    python scripts/run_suite.py [PYTEST ARGS...]        # e.g. -x, -k name; given to both lanes

Lane `shared`: the tests that need the work a session shares, the learning tests (the SFT base and the reward
model, trained in the background: tests/trainers/conftest.py) and the cluster tests (the local Slurm cluster and
its jobs: tests/cluster/conftest.py). Lane `rest`: every other test. One pytest process runs the tests one after
the other, so the learning tests (most of them one process on one core) waited behind the others and then ran
alone: the last third of a suite on two cores had a core idle about half the time. In two lanes the learning tests
start as soon as the SFT base is there and run beside the other tests.

Each lane's lines are printed as they come, prefixed with the lane's name; its pytest summary comes last. The exit
status is the worse of the two (a lane that collects nothing, because the arguments deselect all of it, counts as
passed). A process a test left running still holds its lane's output when pytest has exited: the suite waits
OUTPUT_GRACE_S for it, then names it (pid and command line) and ends without it (a fresh-clone run once waited
a minute after its last lane's summary).
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
LANES = {"shared": ["-m", "learning or cluster"], "rest": ["-m", "not learning and not cluster"]}
NO_TESTS_COLLECTED = 5  # pytest's exit code
OUTPUT_GRACE_S = 10.0


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


def main(argv: list[str]) -> int:
    # The built-in assets, once, before two processes would each find them missing and write them.
    subprocess.run([sys.executable, "-m", "hpc_rlhf", "assets"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    start = time.monotonic()
    lock = threading.Lock()
    root = Path(tempfile.mkdtemp(prefix="hpc_rlhf_suite_"))
    procs, threads = {}, []
    for name, selection in LANES.items():
        cmd = [sys.executable, "-m", "pytest", "-q", "--durations=15", f"--basetemp={root / name}", *selection,
               *argv, "tests"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
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
    for name, code in codes.items():
        summary = (root / f"{name}.log").read_text().rstrip().splitlines()[-1:] or ["(no output)"]
        print(f"lane {name}: exit {code}: {summary[0]}")
    print(f"suite: {elapsed / 60:.0f}m{elapsed % 60:02.0f}s in two lanes (logs in {root})")
    worst = max((0 if code == NO_TESTS_COLLECTED else code) for code in codes.values())
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
