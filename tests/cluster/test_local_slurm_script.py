"""scripts/local_slurm.sh answers without touching the machine: usage, `check` for a user who cannot host the
cluster, `status` of a cluster that is not there. (Bringing it up is what the cluster tests' fixture does.)"""

import os
import shutil
import subprocess

import pytest

from tests.distributed import REPO

SCRIPT = REPO / "scripts" / "local_slurm.sh"


def run(*args, env=None, user=None):
    cmd = ["bash", str(SCRIPT), *args]
    if user is not None:
        cmd = ["runuser", "-u", user, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_unknown_command_prints_usage():
    proc = run("start")
    assert proc.returncode == 2 and "usage:" in proc.stderr and "up|down|status|check" in proc.stderr


def test_check_refuses_a_user_who_is_not_root():
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("runuser is needed to run the check as another user")
        proc = run("check", user="nobody")
    else:
        proc = run("check")
    assert proc.returncode == 1 and proc.stdout.strip() == "cannot host: needs root (starts daemons, edits " \
                                                           "/etc/hosts, installs packages)"


def test_up_as_non_root_fails_with_the_reason_before_doing_anything(tmp_path):
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("runuser is needed to run the script as another user")
    prefix = tmp_path / "prefix"
    proc = run("up", env={"LOCAL_SLURM_PREFIX": str(prefix)}, user="nobody" if os.geteuid() == 0 else None)
    assert proc.returncode == 1 and "cannot host the local cluster: needs root" in proc.stderr
    assert not prefix.exists()


def test_status_of_a_cluster_that_is_not_there(tmp_path):
    proc = run("status", env={"LOCAL_SLURM_PREFIX": str(tmp_path / "nothing")})
    assert proc.returncode == 1 and "not up" in proc.stdout
