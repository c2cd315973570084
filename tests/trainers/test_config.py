"""hpc_rlhf/trainers/config.py: the one-model modes' keys; a key a mode would ignore is refused by name."""

import pytest

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.launch.modes import mode_config


@pytest.mark.parametrize("mode", ["rm", "prm", "dpo", "kto", "idpo"])
def test_modes_that_train_padded_rows_refuse_data_packing(mode):
    config = mode_config(mode)
    load_config(config, None, [])  # the defaults load
    with pytest.raises(ConfigError, match=f"data.packing: {mode} trains padded rows"):
        load_config(config, None, ["data.packing=true"])


@pytest.mark.parametrize("mode", ["sft", "rs", "csft"])
def test_modes_that_train_through_sft_take_data_packing(mode):
    assert load_config(mode_config(mode), None, ["data.packing=true"]).data.packing is True
