"""The generated reference pages (scripts/docs_hooks.py) say what the code does: the configuration reference lists
every key of every mode with the default and meaning that `hpc-rlhf MODE --help` prints, and the OpenRLHF page
carries the converter's own flag tables. No mkdocs needed (tests/docs/test_build.py builds the site)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.cli import main
from hpc_rlhf.launch.modes import TRAINING_MODES
from hpc_rlhf.openrlhf import SCRIPTS, flag_table
from hpc_rlhf.utils.imports import import_target

REPO = Path(__file__).resolve().parents[2]


def docs_hooks():
    return import_target(str(REPO / "scripts" / "docs_hooks.py"), "")


def _rows(page: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (escaped bars kept inside their cell)."""
    rows = []
    for line in page.splitlines():
        if line.startswith("| `"):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


@pytest.mark.parametrize("mode", list(TRAINING_MODES))
def test_the_configuration_reference_matches_help(mode, capsys):
    assert main([mode, "--help"]) == 0
    help_lines = capsys.readouterr().out.split("keys (default, meaning):\n", 1)[1].rstrip("\n").splitlines()
    rows = _rows(docs_hooks().mode_reference(mode))
    assert len(rows) == len(help_lines)
    for (key, kind, default, allowed, meaning), line in zip(rows, help_lines):
        key, default = key.strip("`"), default.strip("`")
        choices = re.findall(r"`([^`]*)`", allowed)
        shown = meaning + (f" [{'|'.join(choices)}]" if choices else "")
        # --help: key, default and meaning (with the choices) in columns
        assert re.fullmatch(rf"\s+{re.escape(key)}\s+{re.escape(default)}\s*{re.escape(shown.strip())}", line), \
            (line, key, default, shown)
        assert kind


def test_the_openrlhf_page_has_the_converters_tables_and_the_worked_example():
    page = docs_hooks().openrlhf_reference()
    for mode in SCRIPTS:
        assert flag_table(mode) in page
    assert "placement: actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4" in page


def test_the_generated_pages_import_neither_torch_nor_transformers():
    """The reference is read from the config classes alone: a docs build (the hook runs in mkdocs' process) costs no
    torch import (a 10 -> 3 CPU-second build, 2026-11-30) and works where torch is not installed."""
    script = ("import runpy, sys; hooks = runpy.run_path(sys.argv[1]); hooks['config_reference'](); "
              "hooks['openrlhf_reference'](); "
              "heavy = sorted({'torch', 'transformers', 'deepspeed'} & set(sys.modules)); "
              "sys.exit(f'imported {heavy}' if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", script, str(REPO / "scripts" / "docs_hooks.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
