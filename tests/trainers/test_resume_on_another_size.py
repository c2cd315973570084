"""The one-model recipes beside SFT (reward model, DPO, KTO) resume on another number of ranks (issue 36, point 1).

SFT's own test (tests/trainers/test_sft.py) and the engine's (tests/engines/test_reshard.py, ZeRO 0, 2 and 3) show
the resharding itself; here each recipe's checkpoint, written by 2 ranks under ZeRO-3, is resumed on 1 rank from
the same output folder: what the recipe adds to the engine's state (a reward model's new head, the frozen
reference DPO and KTO load again from `model.path`, the data position) must come back as the uninterrupted run
had it. Step 2's figures come from the restored weights before any update of the resumed run; step 3's after one,
so a reset optimizer state would show there (SFT's test measured 1.8% on the loss).

The micro-batches hold the same rows on both sizes, since some losses are means over a micro-batch: DPO's SFT term
averages over a micro-batch's tokens (4 and then 8 rows a micro-batch moved step 2's loss by 0.06%), and KTO
estimates its reference point z0 per micro-step over the data-parallel group (hpc_rlhf.trainers.kto), so a KTO step
is one micro-batch on every rank (4 rows on each of 2 ranks, then 8 on 1; micro-batches of 2 rows moved step 2's
loss by 0.5% on 1 rank). Rows go to ranks in contiguous shares (hpc_rlhf.data.order), so micro-batches of 2 rows
are the same on 2 ranks and on 1.
"""

from __future__ import annotations

import shutil

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import hpc_rlhf_cli
from tests.recipes import QUIET

# Each mode's settings and its micro-batch sizes on 2 ranks and on 1 (the module docstring says why they differ).
MODES = {
    "rm": (["--config", "examples/tiny/rm.yaml"], 2, 2),
    "dpo": (["--config", "examples/tiny/dpo.yaml", "eval.prompt_files=[]"], 2, 2),
    "kto": (["--config", "examples/tiny/kto.yaml", "eval.prompt_files=[]"], 4, 8),
}


@pytest.mark.parametrize("mode", MODES)
def test_a_two_rank_zero3_checkpoint_resumes_on_one_rank(tmp_path, mode):
    settings, micro_on_two, micro_on_one = MODES[mode]
    common = [mode, *settings, *QUIET, "train.zero_stage=3", "train.max_steps=3", "train.batch_size=8",
              "train.lr=3e-3", "train.warmup_steps=0", "log.every_steps=1",
              "log.eval_every_steps=0", "checkpoint.every_steps=1", "checkpoint.keep=3", "data.max_train_rows=64",
              "data.max_eval_rows=8"]
    whole = tmp_path / "whole"
    hpc_rlhf_cli(*common, f"output_dir={whole}", "dist.nproc=2", f"train.micro_batch_size={micro_on_two}",
                 timeout=300)
    expected = {r["step"]: r for r in read_metrics(whole) if r["step"] > 1 and "loss" in r}
    assert sorted(expected) == [2, 3]

    resumed = tmp_path / "on1"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000001", resumed / "checkpoints" / "step_000000001")
    proc = hpc_rlhf_cli(*common, f"output_dir={resumed}", "dist.nproc=1", f"train.micro_batch_size={micro_on_one}",
                        timeout=300)
    assert "resumed step 1 written by 2 ranks on 1" in proc.stdout + proc.stderr
    got = {r["step"]: r for r in read_metrics(resumed) if "loss" in r}
    assert sorted(got) == [2, 3]
    for step, want in expected.items():
        assert got[step]["lr"] == want["lr"]
        assert got[step]["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-5), (step, got[step], want)
        assert got[step]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3), (step, got[step], want)
