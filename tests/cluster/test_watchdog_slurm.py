"""Lost ranks under Slurm: sbatch/tiny_cpu.sbatch's PPO on 2 nodes x 2 tasks (conftest.lost_rank_jobs) loses rank 0
(the actor's, beside the store's process) by kill -9, and the rollout rank on the other node by a freeze (SIGSTOP).
Each job must end non-zero within the bound after the fault, and its output must name the lost rank, its role and
its phase. Every role's loss in each kind of phase is tested under torchrun and the local launcher
(tests/trainers/test_failures.py).

(This file's name sorts after the others: when the whole folder runs, `tiny_jobs` submits these jobs together
with every other job of the session, and the tests here find them finished.)"""

import re
from datetime import datetime

import pytest

from tests.cluster.conftest import LOST_RANK_CASES, LOST_RANK_HEARTBEAT_S

pytestmark = pytest.mark.cluster

# The bound on CPU: from the fault to the end of the job. A killed rank is found at once (its pid is
# gone: both local nodes share one host), a frozen one after the heartbeat timeout (20 s); srun's
# --kill-on-bad-exit then ends the step. Without the watchdog the job would wait in gloo (dist.timeout_s=300).
END_BOUND_S = 60
assert LOST_RANK_HEARTBEAT_S < END_BOUND_S


@pytest.mark.parametrize("index", range(len(LOST_RANK_CASES)),
                         ids=[f"{kind}-{role}-{phase}" for role, phase, _, kind in LOST_RANK_CASES])
def test_a_lost_rank_ends_the_slurm_job_naming_its_rank_and_role(cluster, lost_rank_jobs, index):
    lost = lost_rank_jobs[index]
    kind = lost.kind
    record = cluster.wait(lost.job.job_id)
    log = lost.job.log.read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", f"{record}\n{log[-4000:]}"

    faults = re.findall(r"hpc_rlhf: injected fault \(.*\) at rank (\d+), phase (\w+), step (\d+) "
                        r"\[unix time ([\d.]+)\]", log)
    assert [f[:3] for f in faults] == [(str(lost.rank), lost.phase, str(lost.step))], log[-4000:]
    # EndTime is Slurm's local time, to the second.
    ended = datetime.fromisoformat(record["EndTime"]).timestamp()
    assert ended - float(faults[0][3]) <= END_BOUND_S, f"{record}\n{log[-4000:]}"

    verb = "failed" if kind == "kill" else "stopped responding"
    lines = [line for line in log.splitlines() if line.startswith("hpc_rlhf: rank")]
    # Rank 0's death too is named with its phase: the store is served by a process of its own.
    expected = f"hpc_rlhf: rank {lost.rank} (role {lost.role}) {verb} during {lost.phase}: "
    assert lines and all(line.startswith(expected) and f"[step {lost.step}" in line for line in lines), \
        "\n".join(lines) or log[-4000:]
    # Every other rank said so, on both nodes (srun's SIGTERM to the step only asks them to stop). A frozen
    # rank that Slurm's SIGCONT wakes before it is killed may print the record about itself, without "seen by".
    seen_by = {int(m.group(1)) for line in lines if (m := re.search(r"seen by rank (\d+)\]", line))}
    assert seen_by == set(range(4)) - {lost.rank}, "\n".join(lines)
