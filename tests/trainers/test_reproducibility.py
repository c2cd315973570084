"""A seeded CPU run gives the same metrics whatever else the machine is doing (issue: the suite's learning
figures moved between machines; utils/cpu_kernels.py says what was measured)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.distributed import hpc_rlhf_cli

# Two micro-batches per step and two evaluations: every kind of sum a longer run makes, and a bit that differs in
# any of them changes every figure logged after it.
SHORT_SFT = ["--config", "examples/tiny/sft.yaml", "train.max_steps=12", "train.batch_size=64",
             "train.micro_batch_size=32", "log.every_steps=3", "log.eval_every_steps=6", "eval.max_rows=40",
             "data.max_eval_rows=64", "log.progress=false", "log.tensorboard=false", "checkpoint.resume=false"]
CLOCK_KEYS = ("time", "tokens_per_s")
# Two threads each, waiting passively: a spinning thread (OpenMP's default) beside the busy process burns its
# core while it waits for its partner (the loaded run took 32 CPU-seconds instead of 13). How threads wait does
# not change which thread adds what, so the figures are the same either way.
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


def figures(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in CLOCK_KEYS} for row in rows]


def test_seeded_sft_repeats_bit_for_bit_on_a_quiet_and_on_a_loaded_machine(tmp_path):
    hpc_rlhf_cli("sft", *SHORT_SFT, f"output_dir={tmp_path / 'quiet'}", threads=2, env=PASSIVE)
    # One busy process: with the run's 2 threads, 3 want the 2 cores, so the run's threads are preempted and
    # resumed at other times than in the quiet run (a second busy process would burn ~20 CPU-seconds more).
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        time.sleep(0.5)  # the busy processes are running before the run starts
        hpc_rlhf_cli("sft", *SHORT_SFT, f"output_dir={tmp_path / 'loaded'}", threads=2, env=PASSIVE)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    quiet, loaded = figures(tmp_path / "quiet" / "metrics.jsonl"), figures(tmp_path / "loaded" / "metrics.jsonl")
    assert [row["step"] for row in quiet] == [0, 3, 6, 9, 12]
    assert sum("eval_loss" in row for row in quiet) == 3 and all("loss" in row for row in quiet[1:])
    assert quiet == loaded
