"""Every example config loads and passes its mode's checks (keys, values, placement against the config), so a user
who copies one starts from a config that runs. The mode is the file name's first word (grpo_calculator.yaml is a
grpo config)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from hpc_rlhf.cli import TRAINING_MODES
from hpc_rlhf.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "tiny").glob("*.yaml"))


def test_the_examples_are_found():
    assert {"ppo", "grpo", "grpo_calculator", "grpo_guess", "sft"} <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_config_loads_and_passes_its_modes_checks(path):
    mode = path.stem.split("_")[0]
    assert mode in TRAINING_MODES, f"{path.name}: its first word names no mode"
    load_config(importlib.import_module(TRAINING_MODES[mode]).Config, path)
