"""tests/ci_skips.py: with CI=true a skipped cluster, mpi or vllm test fails the run; a CUDA-only test may skip.
Checked on a small test module run by a pytest of its own with only these hooks."""

import os
import subprocess
import sys

import pytest

from tests.ci_skips import in_ci, must_run
from tests.distributed import REPO

MODULE = '''
import pytest

@pytest.mark.cluster
def test_cluster():
    pytest.skip("local Slurm cluster is not up")

@pytest.mark.mpi
@pytest.mark.skipif(True, reason="Open MPI is not installed here")
def test_mpi():
    pass

@pytest.mark.vllm
@pytest.mark.cuda
def test_vllm_on_cuda():
    pass

def test_other():
    pytest.skip("nothing to do with CI")

@pytest.mark.vllm
@pytest.mark.xfail(reason="expected", strict=True)
def test_vllm_xfail():
    assert False
'''


def run_module(tmp_path, ci: str | None) -> dict[str, str]:
    (tmp_path / "test_module.py").write_text(MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cluster: the local Slurm\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-rA",
                           str(tmp_path / "test_module.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    outcomes = {}
    for line in proc.stdout.splitlines():
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"):
            if line.startswith(word):
                name = line.split("::")[-1].split()[0] if "::" in line else line.split(":")[-1].strip()
                outcomes[name] = word
    return outcomes | {"_exit": str(proc.returncode), "_out": proc.stdout}


def test_in_ci_a_skip_of_a_test_the_machine_can_run_fails(tmp_path):
    got = run_module(tmp_path, "true")
    assert got["_exit"] == "1", got["_out"]
    # A skip in the test's body fails it; one at set-up (skipif, a fixture) is reported as an error of set-up.
    assert got["test_cluster"] == "FAILED" and got["test_mpi"] == "ERROR", got["_out"]
    assert "CI=true: this `cluster` test was skipped (Skipped: local Slurm cluster is not up)" in got["_out"]
    assert "test_other" not in got or got["test_other"] != "FAILED"
    assert {got.get("test_vllm_xfail"), got.get("test_other")} == {"XFAIL", None}, got["_out"]  # "-rA" lists
    assert "needs a CUDA GPU" in got["_out"] and "test_vllm_on_cuda" not in got  # the CUDA skip stays a skip


@pytest.mark.parametrize("environ,expected", [({"CI": "true"}, True), ({"CI": "1"}, True), ({"CI": "false"}, False),
                                              ({}, False)])
def test_in_ci(environ, expected):
    assert in_ci(environ) is expected


def test_cuda_marker_allows_the_skip():
    assert must_run({"vllm"}) == "vllm" and must_run({"vllm", "cuda"}) is None and must_run({"learning"}) is None
