"""Checkpoints and stopping (hpc_rlhf/runtime/checkpointing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_rlhf.config import ConfigError
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


def test_a_resume_that_finds_checkpoints_but_none_that_verifies_refuses_naming_each(tmp_path):
    """A fresh start would train from step 0 over the checkpoints: refused instead (a ConfigError: exit 2), in one
    line naming every folder and why it failed; with one that verifies, the newest such is used."""
    one_rank_world()
    run = a_run(tmp_path, "checkpoint.resume=true")
    older = checkpointing.save_checkpoint(run, 2, {"model": FakeEngine()})
    newer = checkpointing.save_checkpoint(run, 4, {"model": FakeEngine()})
    rng_file = newer / "rng" / "rank00000.pt"
    rng_file.write_bytes(bytes([rng_file.read_bytes()[0] ^ 1]) + rng_file.read_bytes()[1:])
    assert checkpointing.choose_checkpoint(run) == (2, older)
    (older / ckpt.MARKER).unlink()
    with pytest.raises(ConfigError) as refused:
        checkpointing.resume_if_possible(run, {"model": FakeEngine()})
    message = str(refused.value)
    assert isinstance(refused.value, checkpointing.CheckpointError) and "\n" not in message
    assert message.startswith("checkpoint.resume=true: no checkpoint in ")
    assert f"{newer}: file rng/rank00000.pt does not match its crc32 checksum" in message
    assert f"{older} has no COMPLETE.json" in message and "checkpoint.resume=false" in message
    assert run.start_step == 0


def test_the_rng_states_resume_bit_for_bit_on_the_same_ranks_and_derive_from_the_seed_on_others(tmp_path):
    one_rank_world()
    run = a_run(tmp_path, "checkpoint.resume=true", "train.seed=11")
    path = checkpointing.save_checkpoint(run, 3, {})
    saved = torch.load(path / "rng" / "rank00000.pt", weights_only=True)
    assert saved["seed"] == 11 and saved["world_size"] == 1
    after_save = torch.rand(4)
    checkpointing.restore_rng(run, path, 3)
    assert torch.equal(torch.rand(4), after_save)

    saved["world_size"] = 2  # as if written by a job of two ranks
    torch.save(saved, path / "rng" / "rank00000.pt")
    draws = []
    for _ in range(2):
        checkpointing.restore_rng(run, path, 3)
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], after_save)
    other_rank = a_run(tmp_path, "train.seed=11", rank=1, world_size=1)
    checkpointing.restore_rng(other_rank, path, 3)  # no file of its own: the seed is rank 0's
    assert not torch.equal(torch.rand(4), draws[0])


def test_model_folders_go_into_the_scheduled_checkpoints_only(tmp_path):
    """checkpoint.save_hf: a checkpoint of every_steps holds each model's folder (hf/<name>); one that only a stop
    signal asked for holds none (the stop's lead is for the resume's state), nor does the last step's (final/)."""
    from hpc_rlhf.config import LoraSection

    one_rank_world()
    run = a_run(tmp_path, "checkpoint.every_steps=2", "checkpoint.save_hf=true", "checkpoint.keep=5")
    run.logger = FakeEngine()
    trained, model = FakeEngine(), FakeEngine()
    models = {"model": checkpointing.ModelToSave(model, "the tokenizer", LoraSection())}

    def folders_written() -> list[Path]:
        return [call[1].relative_to(tmp_path) for call in model.calls if call[0] == "save_hf"]

    checkpointing.checkpoint_or_stop(run, 2, {"model": trained}, False, 6, hf_models=models)
    assert folders_written() == [Path("checkpoints/.staging-step_000000002/hf/model")]
    assert model.calls[0][2] == "the tokenizer"
    checkpointing.checkpoint_or_stop(run, 3, {"model": trained}, False, 6, hf_models=models)  # not due: nothing
    with pytest.raises(checkpointing.Preempted):
        checkpointing.checkpoint_or_stop(run, 5, {"model": trained}, True, 6, hf_models=models)
    checkpointing.checkpoint_or_stop(run, 6, {"model": trained}, False, 6, hf_models=models)
    assert len(folders_written()) == 1  # none at the stop's step 5, none at the last step 6
    assert [c[1].name for c in trained.calls if c[0] == "save_checkpoint"] == ["model"] * 3  # steps 2, 5 and 6
    run_off = a_run(tmp_path / "off", "checkpoint.every_steps=2")
    run_off.logger = FakeEngine()
    checkpointing.checkpoint_or_stop(run_off, 2, {"model": trained}, False, 6, hf_models=models)
    assert len(folders_written()) == 1  # checkpoint.save_hf is off by default
