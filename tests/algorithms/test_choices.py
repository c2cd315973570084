import subprocess
import sys

import pytest

from hpc_rlhf.algorithms.choices import DEFAULT_IS_CAP, resolve_is_correction
from tests.distributed import REPO


def test_the_choices_import_no_torch():
    """The RL config validates against them in `--help` and `--dry-run`, which must not pay torch's import."""
    code = "import sys, hpc_rlhf.algorithms.choices; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.parametrize("tis_cap, max_staleness, expected", [
    (None, 0, ("none", {})),                             # synchronous, no key set: no weights, as today
    (None, 1, ("tis_token", {"cap": DEFAULT_IS_CAP})),   # asynchronous: token TIS at 2, as today
    (None, 3, ("tis_token", {"cap": 2.0})),
    (1.5, 0, ("tis_token", {"cap": 1.5})),               # rl.tis_cap set: token TIS at that cap, as today
    (4.0, 2, ("tis_token", {"cap": 4.0})),
])
def test_auto_keeps_todays_behaviour(tis_cap, max_staleness, expected):
    assert resolve_is_correction("auto", tis_cap, max_staleness) == expected


def test_resolver_refuses_keys_the_mode_does_not_use():
    with pytest.raises(ValueError, match="rl.is_correction must be one of auto, none, tis_token"):
        resolve_is_correction("tis")
    with pytest.raises(ValueError, match=r"rl.tis_cap=2.0 .* rl.is_correction=none"):
        resolve_is_correction("none", 2.0)
    with pytest.raises(ValueError, match=r"rl.tis_cap=2.0 .* rl.is_correction=mis_seq"):
        resolve_is_correction("mis_seq", 2.0)
    with pytest.raises(ValueError, match=r"rl.is_low/rl.is_high .* rl.is_correction=auto"):
        resolve_is_correction("auto", is_high=2.0)
    with pytest.raises(ValueError, match=r"rl.is_low/rl.is_high .* rl.is_correction=tis_seq"):
        resolve_is_correction("tis_seq", is_low=0.5)
    with pytest.raises(ValueError, match="0 <= rl.is_low < 1 < rl.is_high"):
        resolve_is_correction("mis_token", is_low=0.5, is_high=0.9)
    with pytest.raises(ValueError, match="rl.tis_cap must be > 0"):
        resolve_is_correction("auto", 0.0)
    with pytest.raises(ValueError, match="rl.max_staleness must be >= 0"):
        resolve_is_correction("auto", None, -1)
