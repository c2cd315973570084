"""Every GPU sbatch script, shrunk to the local two-node cluster (conftest.gpu_script_jobs): submitted as its own
file with its example config (examples/cluster/), only the allocation, the placement and the model, data and batch
keys overridden, each trains a few steps with its roles on both fake nodes and writes its final model. ppo_70b's
run (ZeRO-3, Adam offload, as its config says) overruns its stop (a rank hangs), is requeued by the requeue guard
before its time limit and resumes; its ranks see the CPUs per task the job asked for (SRUN_CPUS_PER_TASK,
sbatch/common.sh). The clean stop (exit 75, requeued by the script) is tests/cluster/test_preemption.py's."""

import math
import re

import pytest

from tests.cluster.conftest import SHRUNK_CPUS_PER_TASK, SHRUNK_LAYOUTS, SLOW_STOP_MARGIN_S

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("script", sorted(SHRUNK_LAYOUTS))
def test_gpu_script_runs_shrunk_across_both_nodes(cluster, gpu_script_jobs, script):
    run = gpu_script_jobs[script]
    record = cluster.wait(run.job.job_id)
    log = run.job.log.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log[-4000:]}"
    assert record["NodeList"] == "node[1-2]"
    # The script checked its example config (with the arguments the ranks got) before any rank started.
    assert f"config=examples/cluster/{script.removesuffix('.sbatch')}.yaml" in log and "the plan fits" in log
    rows = run.job.metrics()
    assert [r["step"] for r in rows] == list(range(1, run.steps + 1)), log[-3000:]
    assert all(math.isfinite(r["reward" if run.placement else "loss"]) for r in rows), rows
    assert (run.job.output_dir / "final" / "model.safetensors").is_file()
    if run.placement and "critic" in run.placement:
        assert (run.job.output_dir / "final_critic" / "model.safetensors").is_file()


def test_ppo_70b_shrunk_overruns_its_stop_and_the_guard_requeues_it_to_resume(cluster, gpu_script_jobs):
    """A stop that overruns: the critic rank hangs entering step 2's checkpoint, deaf to the stop signals
    (conftest.SLOW_STOP_FAULT, first run only), so the ranks never stop; the job's limit is cut to 1-2 minutes
    away, within the requeue guard's margin. The guard requeues the job, which resumes from step 1's checkpoint
    (step 2's was never sealed) and finishes."""
    run = gpu_script_jobs["ppo_70b.sbatch"]
    record = cluster.wait(run.job.job_id)
    log = run.job.log.read_text()
    assert run.preemption.done.wait(30) and run.preemption.error is None, run.preemption.error
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", f"{record}\n{log[-4000:]}"
    assert "injected fault (HPC_RLHF_FAULT: kind=hang,rank=1,phase=checkpoint,step=2)" in log, log[-4000:]
    assert "requeue guard: the ranks have not stopped" in log and f"(margin {SLOW_STOP_MARGIN_S} s)" in log
    assert "ranks checkpointed and stopped" not in log and "restart 1] mode=ppo" in log
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and resumed[0].endswith("(step 1)"), log[-4000:]
    assert [r["step"] for r in run.job.metrics()] == list(range(1, run.steps + 1))
    assert (run.job.output_dir / "final" / "model.safetensors").is_file()
    config = (run.job.output_dir / "config.yaml").read_text()
    assert re.search(r"adam_offload: true", config) and "zero_stage: 3" in config  # the example config's settings


def test_the_smoke_job_measures_the_all_reduce_across_both_nodes_before_its_rl_steps(cluster, gpu_script_jobs):
    """sbatch/smoke_gpu.sbatch shrunk: the all-reduce over its two ranks (gloo here, one per fake node), then two
    GRPO steps with a vLLM engine (CPU build, tensor-parallel 1) synced after each (test above: steps, final
    model)."""
    run = gpu_script_jobs["smoke_gpu.sbatch"]
    record = cluster.wait(run.job.job_id)
    log = run.job.log.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log[-4000:]}"
    measured = re.findall(r"^all-reduce of 256 MB over 2 ranks \(gloo\): [\d.,]+ ms, algorithm bandwidth "
                          r"[\d.,]+ GB/s, bus bandwidth [\d.,]+ GB/s$", log, re.MULTILINE)
    assert len(measured) == 1, log[-4000:]
    assert log.index(measured[0]) < log.index("INFO hpc_rlhf: placement:")  # the fabric before the RL steps
    rows = run.job.metrics()
    assert [r["step"] for r in rows] == [1, 2] and all(r["weight_sync_mb"] > 0 for r in rows), rows


def test_ranks_see_the_cpus_per_task_of_the_job(cluster, gpu_script_jobs):
    run = gpu_script_jobs["ppo_70b.sbatch"]
    cluster.wait(run.job.job_id)
    probes = re.findall(r"^CPUS rank=(\d+) step=(\d+) cpus_per_task=(\d*) srun_cpus_per_task=(\d*)$",
                        run.job.log.read_text(), re.MULTILINE)
    # 4 ranks before the preemption and 4 after the requeue, each told the job's --cpus-per-task by srun.
    assert sorted(int(rank) for rank, *_ in probes) == [0, 0, 1, 1, 2, 2, 3, 3], probes
    want = str(SHRUNK_CPUS_PER_TASK)
    assert all(cpus == want and srun_cpus == want for _, _, cpus, srun_cpus in probes), probes
