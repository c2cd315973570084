"""`sbatch sbatch/tiny_cpu.sbatch` on the local two-node cluster: the tiny SFT on a rank on node1 and one on node2,
and the default PPO job on two ranks of each, train and finish."""

import json
import math

import pytest

from tests.cluster.conftest import STEPS

pytestmark = pytest.mark.cluster


def test_tiny_job_trains_across_two_nodes_and_writes_metrics_and_final_model(cluster, tiny_jobs):
    job = tiny_jobs.reference
    record = cluster.wait(job.job_id)
    log = job.log.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log[-4000:]}"
    assert record["ExitCode"] == "0:0" and record["Restarts"] == "0"
    assert record["NumNodes"] == "2" and record["NumTasks"] == "2" and record["NodeList"] == "node[1-2]"
    assert "the plan fits" in log  # the placement was checked before the ranks started

    rows = job.metrics()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # it learned, not only ran
    assert "eval_loss" in rows[-1]

    state = json.loads((job.output_dir / "checkpoints" / f"step_{STEPS:09d}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == STEPS
    final = job.output_dir / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "llama"
    assert (final / "model.safetensors").stat().st_size > 0


def test_default_tiny_job_runs_ppo_with_roles_on_both_nodes(cluster, tiny_jobs):
    """`sbatch sbatch/tiny_cpu.sbatch` as shipped: SFT and RM steps, then PPO with actor, critic, ref+reward and
    a rollout engine placed across node1 and node2 as `hpc-rlhf plan` printed it."""
    job = tiny_jobs.ppo
    record = cluster.wait(job.job_id)
    log = job.log.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log[-4000:]}"
    assert record["NodeList"] == "node[1-2]" and record["NumTasks"] == "4"
    assert "the plan fits" in log
    rows = job.metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward"]) and math.isfinite(r["value_loss"]) for r in rows)
    assert (job.output_dir / "final" / "model.safetensors").is_file()
    assert (job.output_dir / "final_critic" / "model.safetensors").is_file()
    state = json.loads((job.output_dir / "checkpoints" / "step_000000003" / "trainer_state.json").read_text())
    assert state["world_size"] == 4 and state["mode"] == "ppo"


def test_a_job_resubmitted_on_one_node_resumes_the_checkpoint_of_two(cluster, tiny_jobs, tmp_path):
    """The path users take when the allocation changes (issue 36): the two-node job's output folder (copied, so
    that the other tests read the reference run as it ended) given to the same script on one node with more steps:
    it resumes the two ranks' last checkpoint on one rank and goes on from the next step."""
    import shutil

    from tests.cluster.conftest import Submitted

    reference = tiny_jobs.reference
    assert cluster.wait(reference.job_id)["JobState"] == "COMPLETED"
    out = tmp_path / "resubmitted"
    (out / "checkpoints").mkdir(parents=True)
    last = f"step_{STEPS:09d}"
    shutil.copytree(reference.output_dir / "checkpoints" / last, out / "checkpoints" / last)
    job_id = cluster.sbatch("--nodes=1", "--ntasks-per-node=1", f"--output={tmp_path}/resubmitted-%j.out",
                            "sbatch/tiny_cpu.sbatch", f"output_dir={out}", f"train.max_steps={STEPS + 2}",
                            env={"MODE": "sft", "CONFIG": str(tiny_jobs.config)})
    job = Submitted(job_id, out, tmp_path / f"resubmitted-{job_id}.out")
    record = cluster.wait(job_id)
    log = job.log.read_text()
    assert record["JobState"] == "COMPLETED" and record["NumNodes"] == "1", f"{record}\n{log[-4000:]}"
    assert f"resumed step {STEPS} written by 2 ranks on 1" in log, log[-4000:]
    assert [r["step"] for r in job.metrics()] == [STEPS + 1, STEPS + 2]
    assert (out / "final" / "model.safetensors").is_file()
