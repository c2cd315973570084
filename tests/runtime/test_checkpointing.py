"""Checkpoints and stopping (hpc_rlhf/runtime/checkpointing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hpc_rlhf.runtime import checkpointing
from hpc_rlhf.utils import checkpoint as ckpt
from tests.recipes import FakeEngine, a_run, one_rank_world


def test_what_a_recipe_saves_beside_its_engines_is_sealed_in_the_same_checkpoint(tmp_path):
    """`save_extra` (the RL recipe's batches in flight) writes into the staging folder and adds trainer-state
    entries: both are part of the committed, verified checkpoint, and resuming says where it was."""
    one_rank_world()
    run = a_run(tmp_path, "checkpoint.resume=true")

    def save_extra(staging: Path) -> dict:
        (staging / "rollout").mkdir()
        torch.save({"tokens": torch.arange(5)}, staging / "rollout" / "engine000.pt")
        return {"in_flight": {"7": 6}}

    final = checkpointing.save_checkpoint(run, 6, {"model": FakeEngine()}, save_extra=save_extra)
    assert ckpt.verify(final) is None
    assert "rollout/engine000.pt" in json.loads((final / ckpt.MARKER).read_text())["files"]
    state = checkpointing.resume_if_possible(run, {"model": FakeEngine()})
    assert state["in_flight"] == {"7": 6} and state["step"] == 6
    assert run.extra["resumed_from"] == final
