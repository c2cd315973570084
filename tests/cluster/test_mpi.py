"""The tiny job started by MPI on the local cluster: `mpirun -n 2` inside an allocation and `srun --mpi=pmix`."""

import pytest

from tests.cluster.conftest import MPI_STEPS

pytestmark = pytest.mark.cluster


def probes(log: str) -> list[tuple[str, int, int]]:
    out = []
    for line in log.splitlines():
        if line.startswith("PROBE "):
            _, launcher, rank, world = line.split()
            out.append((launcher, int(rank), int(world)))
    return sorted(out, key=lambda p: p[1])


def check_finished(cluster, job) -> str:
    record = cluster.wait(job.job_id)
    log = job.log.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log[-4000:]}"
    rows = job.metrics()
    assert [r["step"] for r in rows] == list(range(1, MPI_STEPS + 1)) and "eval_loss" in rows[-1]
    assert (job.output_dir / "final" / "model.safetensors").is_file()
    return log


def test_mpirun_ranks_bootstrap_from_mpi_and_train(cluster, tiny_jobs):
    log = check_finished(cluster, tiny_jobs.mpirun)
    # Both ranks inherit the batch step's SLURM_PROCID=0: only MPI knows who is who, and mpi4py the master.
    assert probes(log) == [("mpi", 0, 2), ("mpi", 1, 2)], log[-3000:]


def test_srun_pmix_ranks_train_across_two_nodes(cluster, tiny_jobs):
    log = check_finished(cluster, tiny_jobs.srun_pmix)
    # Under srun with PMIx, MPI and Slurm agree on every rank; the Slurm variables give the node layout.
    assert probes(log) == [("slurm", 0, 2), ("slurm", 1, 2)], log[-3000:]
    assert cluster.job_fields(tiny_jobs.srun_pmix.job_id)["NodeList"] == "node[1-2]"
