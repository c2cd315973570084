"""The one check `hpc-rlhf plan` and `hpc-rlhf simulate` run on what they are given (world size, ranks per node,
placement, model, hardware profile) before computing anything, and the one way they refuse, which a training
mode's dry run shares (hpc_rlhf.dist.allocation): exit code 2 and one line on stderr that names the flag to change
(`refuse`), what shows why (the plan so far) on stdout. Pure Python, no torch (`plan` runs on login nodes).

    job = check_job(world_size=1024, gpus_per_node=8, placement="actor=256,...", model="70b", hardware="h100")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from hpc_rlhf.dist import plan_cli
from hpc_rlhf.dist.allocation import AllocationError
from hpc_rlhf.dist.memory import ModelShape, ModelShapeError, load_shape
from hpc_rlhf.dist.placement import Plan, PlacementError, make_plan
from hpc_rlhf.scale import hardware

FLAGS = {"world_size": "--world-size", "gpus_per_node": "--gpus-per-node", "placement": "--placement",
         "model": "--model", "hardware": "--hardware"}


# Input a command cannot run on: `str()` is one line that starts with the flag to change (the dry run's error too).
JobInputError = AllocationError


@dataclass(frozen=True)
class Job:
    plan: Plan
    shape: ModelShape
    profile: hardware.Profile | None


def load_model(model: str, key: str = FLAGS["model"]) -> ModelShape:
    """A preset name or a model folder / config.json, refused in one line naming `key`."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        raise JobInputError(key, f"the model folder '{model}' has no config.json (a Hugging Face model folder, or a "
                                 f"preset: {', '.join(('7b', '13b', '34b', '70b'))})")
    try:
        return load_shape(model)
    except ModelShapeError as exc:
        raise JobInputError(key, str(exc)) from None


def check_job(world_size: int, gpus_per_node: int, placement, model: str, hardware_name: str | None = None,
              keys: Mapping[str, str] = FLAGS) -> Job:
    """The plan, the model's shape and the hardware profile of a job; JobInputError (one line, naming the flag in
    `keys`) for input they cannot be made from."""
    for name, value in (("world_size", world_size), ("gpus_per_node", gpus_per_node)):
        if value < 1:
            raise JobInputError(keys[name], f"must be at least 1, got {value}")
    try:
        plan = make_plan(placement, world_size, gpus_per_node)
    except PlacementError as exc:  # the first line says what is wrong; the plan so far shows why
        first, _, rest = str(exc).partition("\n")
        raise JobInputError(keys["placement"], first, rest) from None
    shape = load_model(model, keys["model"])
    profile = None
    if hardware_name is not None:
        try:
            profile = hardware.load(hardware_name)
        except hardware.ProfileError as exc:
            raise JobInputError(keys["hardware"], str(exc)) from None
    return Job(plan, shape, profile)


def refuse(prog: str, exc: JobInputError) -> int:
    """How `plan`, `simulate` and a dry run refuse: one line on stderr, what shows why on stdout, exit code 2."""
    return plan_cli.refuse(prog, exc)
