"""The reaper: processes a rank watches end with the rank however it ends (SIGKILL, os._exit as the watchdog
does, a normal exit without shutting them down), and the folder it was given goes with them; after `done()` both
are left alone, and a recycled pid is never hit.
No vLLM here: the watched processes are `sleep`s started by a child interpreter playing the rank, one of them
with a grandchild, as vLLM's engine core has its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hpc_rlhf.engines.rollout import reaper
from tests.distributed import REPO, worker_env

RANK = r"""
import os, signal, subprocess, sys, time
from hpc_rlhf.engines.rollout.reaper import Reaper

how, folder, file = sys.argv[1], sys.argv[2], sys.argv[3]
r = Reaper(remove_when_gone=folder)
r.remove_when_gone(file)
with r.watch_new_children():
    child = subprocess.Popen(["sleep", "300"])
    # An engine core that starts its own worker, then is what the rank knows of.
    parent = subprocess.Popen(["sh", "-c", "sleep 301 & wait"])
    time.sleep(0.5)
print(" ".join(map(str, r.watched)), flush=True)
sys.stdin.readline()  # the test has read the pids
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "os_exit":
    os._exit(1)
elif how == "done":
    r.done()
sys.exit(0)
"""


def wait_gone(pids, timeout_s=15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if (s := reaper.process_stat(p)) is not None and s[2] != "Z"]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def play_rank(how: str, folder) -> tuple[list[int], list[int]]:
    """(the watched pids, every descendant of them) of a rank that then ends as `how` says; the reaper is to
    remove `folder` and the file store beside it if the rank leaves without `done()`."""
    proc = subprocess.Popen([sys.executable, "-c", RANK, how, str(folder), str(folder.parent / "vllm_dist_0123")],
                            cwd=REPO, env=worker_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    watched = [int(p) for p in proc.stdout.readline().split()]
    tree = sorted(set(watched) | set(reaper.descendants(set(watched))))
    proc.stdin.write("go\n")
    proc.stdin.flush()
    proc.wait(timeout=30)
    return watched, tree


@pytest.mark.parametrize("how", ["kill", "os_exit", "exit"])
def test_watched_processes_and_their_children_end_with_the_rank(how, tmp_path):
    folder = engine_folder(tmp_path)
    watched, tree = play_rank(how, folder)
    assert sorted(watched) == tree and len(tree) == 3, (watched, tree)  # both children and the grandchild
    assert wait_gone(tree) == []
    deadline = time.monotonic() + 10
    while (folder.exists() or (tmp_path / "vllm_dist_0123").exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(os.listdir(tmp_path)) == []


def engine_folder(tmp_path):
    """Stand-ins of an engine's socket folder, with what killed processes leave there, and of its file store."""
    folder = tmp_path / "hpc_rlhf_vllm_x"
    (folder / "lora" / "v1").mkdir(parents=True)
    (folder / "3f2a-socket").write_text("a socket")
    (tmp_path / "vllm_dist_0123").write_text("a file store")
    return folder


def test_done_leaves_the_processes_and_the_folder_alone(tmp_path):
    folder = engine_folder(tmp_path)
    watched, tree = play_rank("done", folder)
    try:
        time.sleep(1.0)
        assert wait_gone(tree, timeout_s=0.5) == tree
        assert (folder / "3f2a-socket").is_file() and (tmp_path / "vllm_dist_0123").is_file()
    finally:
        for pid in tree:
            os.kill(pid, signal.SIGKILL)


def test_a_recycled_pid_is_not_killed():
    proc = subprocess.Popen(["sleep", "300"])
    try:
        started = reaper.start_time(proc.pid)
        assert not reaper.kill_if_same(proc.pid, started + 1)  # another process under the same pid
        assert proc.poll() is None
        assert reaper.kill_if_same(proc.pid, started)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
