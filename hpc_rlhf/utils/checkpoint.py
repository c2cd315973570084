"""Atomic checkpoint folders under `output_dir/checkpoints/`.

A checkpoint is written into a staging folder (`.staging-step_000120`), then a `COMPLETE.json` marker listing
every file and its size is written last, and only then is the folder renamed to `step_000120`. A crash or a
kill at any point leaves either the previous complete checkpoint untouched or a staging folder that is ignored
(and cleared on the next save). On resume, the newest folder whose marker matches the files on disk is used;
one that fails the check (truncated file, missing file, missing marker) is reported and skipped, so the
previous one is used instead.

These are plain file-system functions: the trainers decide which rank writes what and place the barriers.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
_NAME = re.compile(r"^step_(\d{9})$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}"


def staging_dir(output_dir: str | Path, step: int) -> Path:
    """Deterministic, so every rank computes the same path without talking to the others."""
    return checkpoints_root(output_dir) / f".staging-{checkpoint_name(step)}"


def prepare_staging(output_dir: str | Path, step: int) -> Path:
    """Create an empty staging folder (one rank calls this, then the ranks synchronise)."""
    path = staging_dir(output_dir, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _file_list(folder: Path) -> dict[str, int]:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MARKER:
            files[str(p.relative_to(folder))] = p.stat().st_size
    return files


def commit(output_dir: str | Path, step: int, meta: dict[str, Any] | None = None, keep: int | None = None) -> Path:
    """Seal the staging folder of `step` and move it into place; then drop old checkpoints beyond `keep`."""
    staging = staging_dir(output_dir, step)
    if not staging.is_dir():
        raise FileNotFoundError(f"no staging folder {staging} to commit")
    marker = {"step": step, "time": time.time(), "files": _file_list(staging), "meta": meta or {}}
    tmp_marker = staging / (MARKER + ".tmp")
    tmp_marker.write_text(json.dumps(marker, indent=1))
    _fsync(tmp_marker)
    os.replace(tmp_marker, staging / MARKER)
    final = checkpoints_root(output_dir) / checkpoint_name(step)
    if final.exists():  # the same step saved again (e.g. a preemption right after a periodic save)
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)
    if keep is not None:
        prune(output_dir, keep)
    return final


def verify(folder: str | Path) -> str | None:
    """None when the checkpoint is complete, else the reason it is not."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        return f"{folder} has no {MARKER} (it was not finished)"
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        return f"{marker} is unreadable: {exc}"
    for name, size in info.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{folder}: file {name} is missing"
        if path.stat().st_size != size:
            return f"{folder}: file {name} has {path.stat().st_size} bytes, expected {size}"
    return None


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_complete(output_dir: str | Path) -> tuple[int, Path] | None:
    """The newest checkpoint that passes `verify`, warning about every newer one that does not."""
    for step, path in reversed(list_checkpoints(output_dir)):
        problem = verify(path)
        if problem is None:
            return step, path
        log.warning("skipping incomplete or corrupt checkpoint: %s", problem)
    return None


def prune(output_dir: str | Path, keep: int) -> None:
    complete = [(s, p) for s, p in list_checkpoints(output_dir) if verify(p) is None]
    for _, path in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    root = checkpoints_root(output_dir)
    for p in root.glob(".staging-*") if root.is_dir() else []:
        # A leftover staging folder of an older step is a crashed save: nothing reads it.
        m = re.match(r"^\.staging-step_(\d{9})$", p.name)
        if m and complete and int(m.group(1)) <= complete[-1][0]:
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ RNG state
def rng_state() -> dict[str, Any]:
    """Every generator's state as plain tensors, ints, floats and strings: what `torch.load(weights_only=True)`
    reads back, so that loading a checkpoint runs no code from it."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy().astype(np.uint32) if isinstance(keys, torch.Tensor) else keys
        np.random.set_state((name, keys, pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
