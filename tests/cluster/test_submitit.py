"""`hpc_rlhf.launch.slurm.submit` on the local cluster: a Python submission of the tiny job, preempted mid-run,
requeues itself from inside the task and returns the results of the resumed run."""

import pytest

from tests.cluster.conftest import STEPS

pytestmark = pytest.mark.cluster


def test_submitit_submission_of_the_tiny_job_survives_preemption_and_returns(cluster, tiny_jobs):
    job, run, signal = tiny_jobs.submitit_job, tiny_jobs.submitit_run, tiny_jobs.submitit_preemption
    results = job.results()  # raises with the task's error if a rank failed
    assert signal.done.wait(30) and signal.error is None, signal.error
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["exit_code"] == 0 and r["restarts"] == 1 for r in results), results
    assert "checkpoint written, requeueing job" in run.log.read_text()
    assert cluster.job_fields(job.job_id)["Restarts"] == "1"
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    assert (run.output_dir / "final" / "model.safetensors").is_file()
    sbatch_text = (run.log.parent / f"{job.job_id}_submission.sh").read_text()
    assert "#SBATCH --signal=USR1@60" in sbatch_text and "#SBATCH --requeue" in sbatch_text
