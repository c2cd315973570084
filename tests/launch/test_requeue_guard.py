"""hpc_rlhf/launch/requeue_guard.sh against a stand-in `scontrol` on PATH: it requeues the job once the time left
comes within its margin (a limit moved while it runs counts), not before, and not past MAX_RESTARTS. The guard on
a real Slurm, with a rank that cannot stop, is tests/cluster/test_sbatch_gpu_scripts.py's ppo_70b job."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime, timedelta
from pathlib import Path

from tests.distributed import REPO

GUARD = REPO / "hpc_rlhf" / "launch" / "requeue_guard.sh"
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
  show) [ -s "$FAKE_SLURM/end" ] && echo "JobId=$SLURM_JOB_ID JobState=$(cat "$FAKE_SLURM/state" 2>/dev/null \
          || echo RUNNING) EndTime=$(cat "$FAKE_SLURM/end") x=y" ;;
  requeue) echo "$2" >> "$FAKE_SLURM/requeued" ;;
  *) exit 1 ;;
esac
"""


def set_end(folder: Path, seconds_from_now: float | None) -> None:
    end = "Unknown" if seconds_from_now is None else \
        (datetime.now() + timedelta(seconds=seconds_from_now)).strftime("%Y-%m-%dT%H:%M:%S")
    (folder / "end").write_text(end)


def start_guard(folder: Path, margin_s: int, max_restarts: int = 20, restarts: int = 0,
                watched: int | None = None) -> subprocess.Popen:
    (folder / "scontrol").write_text(FAKE_SCONTROL)
    (folder / "scontrol").chmod(0o755)
    env = dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}", FAKE_SLURM=str(folder), SLURM_JOB_ID="4242",
               SLURM_RESTART_COUNT=str(restarts), REQUEUE_GUARD_POLL_S="1")
    extra = [] if watched is None else [str(watched)]
    return subprocess.Popen(["bash", str(GUARD), str(margin_s), str(max_restarts), *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_the_guard_waits_while_the_limit_is_far_and_requeues_once_it_comes_within_the_margin(tmp_path):
    (tmp_path / "end").write_text("")  # scontrol answers nothing (the controller is busy)
    guard = start_guard(tmp_path, margin_s=60)
    try:
        time.sleep(2.5)
        set_end(tmp_path, None)  # no limit known yet
        time.sleep(2.5)
        set_end(tmp_path, 3600)
        time.sleep(2.5)
        assert guard.poll() is None and not (tmp_path / "requeued").exists()
        set_end(tmp_path, 30)  # the limit moved (scontrol update): now inside the margin
        _, err = guard.communicate(timeout=20)
    finally:
        guard.kill()
    assert guard.returncode == 0
    assert (tmp_path / "requeued").read_text() == "4242\n"
    assert "have not stopped" in err and "requeueing job 4242" in err and "margin 60 s" in err


def test_the_guard_does_not_requeue_past_max_restarts(tmp_path):
    set_end(tmp_path, 10)
    guard = start_guard(tmp_path, margin_s=60, max_restarts=3, restarts=3)
    _, err = guard.communicate(timeout=20)
    assert guard.returncode == 0 and not (tmp_path / "requeued").exists()
    assert "restarted 3 times (MAX_RESTARTS=3): not requeueing" in err


def test_a_job_that_has_finished_is_not_requeued(tmp_path):
    """Completing, its EndTime is in the past: the guard leaves (the submitit job script's guard outlives the
    batch shell by a moment; a requeue there ran a finished job again)."""
    (tmp_path / "state").write_text("COMPLETING")
    set_end(tmp_path, -20)
    guard = start_guard(tmp_path, margin_s=60)
    _, err = guard.communicate(timeout=20)
    assert guard.returncode == 0 and not (tmp_path / "requeued").exists() and err == ""


def test_the_guard_ends_with_the_batch_shell_it_watches(tmp_path):
    shell = subprocess.Popen(["sleep", "3"])
    set_end(tmp_path, 3600)
    guard = start_guard(tmp_path, margin_s=60, watched=shell.pid)
    try:
        time.sleep(1.5)
        assert guard.poll() is None
        shell.wait()
        set_end(tmp_path, 10)  # the limit is near, but the shell is gone: the job is ending
        guard.communicate(timeout=20)
    finally:
        guard.kill()
    assert guard.returncode == 0 and not (tmp_path / "requeued").exists()


def test_a_term_ends_the_guard_at_once_with_nothing_left_holding_its_output(tmp_path):
    """The batch shell ends the guard with `kill` once the step is over. Wherever that lands (asking scontrol,
    parsing its answer, waiting for the next poll), the guard ends at once and no child of it keeps the job's
    output open: a TERM trap could miss it under bash 5.2, which refuses a trap that arrives while it parses a
    $(...), and a `sleep` child would hold the output until it ended."""
    set_end(tmp_path, 3600)
    for attempt in range(20):
        guard = start_guard(tmp_path, margin_s=60)
        try:
            time.sleep(0.01 + 0.02 * (attempt % 7))  # different moments of its loop (it polls every second)
            guard.terminate()
            started = time.monotonic()
            guard.communicate(timeout=10)  # the pipes close when every process holding them has ended
            assert time.monotonic() - started < 2, f"attempt {attempt}: the guard's output stayed open"
        finally:
            guard.kill()
        assert guard.returncode == -15, (attempt, guard.returncode)  # TERM's own end, no handler
    assert not (tmp_path / "requeued").exists()
