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


BAR_THEN_FAILURE = """
import threading
from tqdm.auto import tqdm
from hpc_rlhf.utils.console import say
bar = tqdm(total=10, desc="grpo", mininterval=0)
bar.update(3)
# A watchdog's line comes from its own thread, while the main thread's bar is open.
thread = threading.Thread(target=say, args=("hpc_rlhf: rank 3 (role critic) failed during training",))
thread.start()
thread.join()
bar.update(1)  # a closed bar draws nothing more
bar.close()
"""


def test_a_failure_line_closes_the_open_progress_bar_first():
    proc = subprocess.run([sys.executable, "-c", BAR_THEN_FAILURE], cwd=REPO, env=worker_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, line, after = proc.stderr.partition("hpc_rlhf: rank 3 (role critic) failed during training")
    assert line and before.endswith("\n") and "grpo:  30%" in before.splitlines()[-1], proc.stderr
    assert after == "\n", proc.stderr


def test_torchs_cpp_warnings_are_quiet_unless_debugging():
    from hpc_rlhf.utils.console import quiet_torch_warnings

    for environ, level in (({}, "ERROR"), ({"HPC_RLHF_DEBUG": "1"}, None), ({"HPC_RLHF_DEBUG": "0"}, "ERROR"),
                           ({"TORCH_CPP_LOG_LEVEL": "INFO"}, "INFO")):
        quiet_torch_warnings(environ)
        assert environ.get("TORCH_CPP_LOG_LEVEL") == level
