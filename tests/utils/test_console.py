"""Lines from several processes on one pipe stay whole (hpc_rlhf.utils.console)."""

from __future__ import annotations

import subprocess
import sys

from tests.distributed import REPO, worker_env

SAYER = """
import sys
from hpc_rlhf.utils.console import say
rank = int(sys.argv[1])
print("buffered first", end="")  # what Python holds goes out before the line
for i in range(400):
    say(f"rank {rank} line {i} " + "x" * 60, fd=1)
"""


def test_lines_of_processes_sharing_a_pipe_never_run_together():
    # The processes share this test's stdout pipe, as ranks share their launcher's; unbuffered, as in a job.
    code = f"import subprocess, sys; ps = [subprocess.Popen([sys.executable, '-c', {SAYER!r}, str(r)]) " \
           f"for r in range(4)]; sys.exit(max(p.wait() for p in ps))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=worker_env({"PYTHONUNBUFFERED": "1"}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.replace("buffered first", "").splitlines()
    assert len(lines) == 4 * 400
    assert all(line.startswith("rank ") and line.endswith("x" * 60) and line.count("rank") == 1 for line in lines)
    for rank in range(4):
        assert [line.split()[3] for line in lines if line.startswith(f"rank {rank} ")] == [str(i) for i in range(400)]
