"""The documentation site builds with `mkdocs build --strict` (mkdocs.yml): the generated reference pages included,
and a broken link, a missing page or a page left out of the navigation fails the build. mkdocs comes with the
`docs` extra, which `make venv` installs; without it the test skips, which fails CI (tests/ci_skips.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.docs,
              pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or
                                 importlib.util.find_spec("material") is None,
                                 reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_site_builds_strictly_with_the_generated_reference(tmp_path):
    proc = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "critic_train.max_grad_norm" in page and "dpo.label_smoothing" in page
    assert "--actor_num_gpus_per_node" in (tmp_path / "site" / "reference" / "openrlhf" / "index.html").read_text()


def test_a_broken_link_or_a_page_left_out_fails_the_build(tmp_path):
    """The same settings on a small site whose page links to a page that does not exist, beside a page that the
    navigation leaves out (without the hook: its pages take seconds to generate; strictness does not depend on
    them)."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config.pop("hooks")
    config["nav"] = ["index.md"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
    (docs / "forgotten.md").write_text("# Not in the navigation\n")
    config["docs_dir"] = str(docs)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "contains a link 'missing.md', but the target is not found" in proc.stderr, proc.stderr[-3000:]
    assert 'are not included in the "nav" configuration:\n  - forgotten.md' in proc.stderr, proc.stderr[-3000:]
