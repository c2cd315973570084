"""Preemption on the local cluster: SIGUSR1 mid-run -> checkpoint -> exit 75 -> the job requeues itself ->
it resumes from the checkpoint -> its metrics equal those of the same job run without interruption."""

import pytest

from tests.cluster.conftest import STEPS

pytestmark = pytest.mark.cluster

# Wall-clock figures differ between runs; everything else must be identical on CPU.
TIMING_KEYS = {"time", "tokens_per_s"}


def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(cluster, tiny_jobs):
    job, signal = tiny_jobs.preempted, tiny_jobs.preemption
    record = cluster.wait(job.job_id)
    assert signal.done.is_set() and signal.error is None, signal.error
    log = job.log.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log[-4000:]}"
    assert record["Restarts"] == "1", record  # requeued once, by the batch script
    assert "ranks checkpointed and stopped (exit 75); requeueing" in log
    assert "restart 1] mode=sft" in log
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, log[-4000:]
    resumed_step = int(resumed[0].rsplit("(step ", 1)[1].rstrip(")"))
    # The checkpoint is of a step after the signal was sent and before the end: the run was cut mid-way.
    assert signal.step_seen <= resumed_step < STEPS

    reference_record = cluster.wait(tiny_jobs.reference.job_id)
    assert reference_record["JobState"] == "COMPLETED"
    resumed_rows = job.metrics()
    reference_rows = tiny_jobs.reference.metrics()
    assert [r["step"] for r in resumed_rows] == [r["step"] for r in reference_rows] == list(range(1, STEPS + 1))
    for got, want in zip(resumed_rows, reference_rows):
        assert set(got) == set(want)
        for key in set(want) - TIMING_KEYS:
            assert got[key] == want[key], (f"step {want['step']}: {key} is {got[key]} after the resume from step "
                                           f"{resumed_step}, {want[key]} without interruption")
    assert (job.output_dir / "final" / "model.safetensors").is_file()
