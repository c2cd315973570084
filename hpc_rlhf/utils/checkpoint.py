"""Atomic checkpoint folders under `output_dir/checkpoints/`.

A checkpoint is written into a staging folder (`.staging-step_000120`). Every data file is then fsynced and its
checksum taken (`seal_files`; in a job each rank takes a share of the files, so the cost is spread), every folder
is fsynced, and a `COMPLETE.json` marker listing every file with its size and checksum is written last; only then
is the folder renamed to `step_000120`. Saving a step that exists already (a stop right after a periodic save)
moves the old folder to `step_000120.old` first. A crash or a kill at any point leaves a folder that verifies: the
previous checkpoint, the sealed staging folder or the `.old` one (`candidates` lists all three kinds, newest
step first); an unsealed staging folder is a crashed save that nothing reads (cleared on the next save).

On resume, the newest candidate whose marker matches the files on disk (sizes and checksums) is used; one that
fails (truncated, missing or changed file, missing marker) is reported and skipped, so an older one is used
instead. Checkpoints of older versions have sizes but no checksums in their marker: they are checked by size.

These are plain file-system functions: the trainers decide which rank writes and seals what, and place the
barriers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
# zlib's CRC-32: 3.9 GB/s on one core here against 1.8 for sha256 (docs/failures.md). What it must find is a torn
# or flipped byte; it is no defence against someone who edits files, since they could rewrite the marker too.
CHECKSUM = "crc32"
_CHUNK = 8 << 20
_NAME = re.compile(r"^step_(\d{9})$")
_STAGING = re.compile(r"^\.staging-step_(\d{9})$")
_OLD = re.compile(r"^step_(\d{9})\.old$")


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


def file_sizes(output_dir: str | Path, step: int) -> dict[str, int]:
    """Every file of the staging folder of `step` with its size: what the ranks share out to seal."""
    return _file_list(staging_dir(output_dir, step))


def share(files: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files that `rank` seals or checks: the largest first, each to the rank with the fewest bytes so far, so
    that one rank does not read a whole checkpoint while the others wait. Deterministic: every rank computes the
    same split from the same listing."""
    load = [0] * world_size
    mine = []
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        owner = load.index(min(load))
        load[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def seal_files(folder: str | Path, names: list[str]) -> dict[str, str]:
    """fsync each of `names` (paths relative to `folder`) and return its checksum. The fsync makes the data
    durable before the marker that vouches for it exists (a crash of the node after the rename otherwise can leave
    a sealed folder with holes in its files)."""
    folder = Path(folder)
    return {name: _seal(folder / name) for name in names}


def _seal(path: Path) -> str:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())  # Linux flushes the file's dirty pages for a read-only descriptor too
        return _crc(fh)


def checksum(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return _crc(fh)


def _crc(fh) -> str:
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    while True:
        n = fh.readinto(buffer)
        if not n:
            return f"{crc:08x}"
        crc = zlib.crc32(view[:n], crc)


def commit(output_dir: str | Path, step: int, meta: dict[str, Any] | None = None, keep: int | None = None,
           checksums: dict[str, str] | None = None) -> Path:
    """Seal the staging folder of `step` and move it into place; then drop old checkpoints beyond `keep`.

    `checksums`: what the ranks' `seal_files` returned for their shares; files it does not cover are sealed here.
    """
    staging = staging_dir(output_dir, step)
    if not staging.is_dir():
        raise FileNotFoundError(f"no staging folder {staging} to commit")
    files = _file_list(staging)
    sums = {name: value for name, value in (checksums or {}).items() if name in files}
    sums.update(seal_files(staging, [name for name in files if name not in sums]))
    for folder in sorted({staging, *(p for p in staging.rglob("*") if p.is_dir())}, reverse=True):
        _fsync_dir(folder)  # the files' directory entries, deepest first, so the marker never outlives them
    marker = {"step": step, "time": time.time(), "files": files, "checksum": CHECKSUM, "checksums": sums,
              "meta": meta or {}}
    tmp_marker = staging / (MARKER + ".tmp")
    tmp_marker.write_text(json.dumps(marker, indent=1))
    _fsync(tmp_marker)
    os.replace(tmp_marker, staging / MARKER)
    _fsync_dir(staging)
    final = checkpoints_root(output_dir) / checkpoint_name(step)
    if final.exists():  # the same step saved again (e.g. a preemption right after a periodic save)
        # Killed between the two renames, the folder that verifies is step_N.old or the sealed staging folder:
        # `candidates` lists both, so a resume finds one of them.
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)
    if keep is not None:
        prune(output_dir, keep)
    return final


def verify(folder: str | Path, names: list[str] | None = None, contents: bool = True) -> str | None:
    """None when the checkpoint is complete, else the reason it is not. Checks the marker and the files `names`
    (every file when None: a rank of a job checks its `share`): each must exist with its size and, unless
    `contents` is False, its checksum. A marker without checksums (an older hpc_rlhf) is checked by size only."""
    folder = Path(folder)
    info, problem = read_marker(folder)
    if problem:
        return problem
    files = info.get("files", {})
    sums = info.get("checksums", {})
    for name in files if names is None else names:
        path = folder / name
        if not path.is_file():
            return f"{folder}: file {name} is missing"
        if path.stat().st_size != files[name]:
            return f"{folder}: file {name} has {path.stat().st_size} bytes, expected {files[name]}"
        if contents and name in sums and checksum(path) != sums[name]:
            return f"{folder}: file {name} does not match its {info.get('checksum', CHECKSUM)} checksum (changed)"
    return None


def read_marker(folder: str | Path) -> tuple[dict, str | None]:
    """The marker of `folder`, or the reason there is none."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return {}, f"{folder} has no {MARKER} (it was not finished)"
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        return {}, f"{marker} is unreadable: {exc}"
    if not isinstance(info, dict) or not isinstance(info.get("files", {}), dict):
        return {}, f"{marker} is not a checkpoint marker"
    return info, None


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


def candidates(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Every folder a resume may use, newest step first: for one step, `step_N`, then its sealed staging folder
    (newer, when a re-save of the step was killed between its two renames), then `step_N.old`. Unsealed staging
    folders are crashed saves, not checkpoints."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        for order, pattern in enumerate((_NAME, _STAGING, _OLD)):
            m = pattern.match(p.name)
            if m and p.is_dir() and (pattern is not _STAGING or (p / MARKER).is_file()):
                found.append((-int(m.group(1)), order, p))
    return [(-neg_step, p) for neg_step, _, p in sorted(found)]


def latest_complete(output_dir: str | Path) -> tuple[int, Path] | None:
    """The newest candidate that passes `verify`, warning about every newer one that does not."""
    for step, path in candidates(output_dir):
        problem = verify(path)
        if problem is None:
            return step, path
        log.warning("skipping incomplete or corrupt checkpoint: %s", problem)
    return None


def prune(output_dir: str | Path, keep: int) -> None:
    # Sizes only: reading every kept checkpoint back at each save would cost what the save cost.
    complete = [(s, p) for s, p in list_checkpoints(output_dir) if verify(p, contents=False) is None]
    for _, path in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    root = checkpoints_root(output_dir)
    for p in root.iterdir() if root.is_dir() and complete else []:
        # A staging folder or a step_N.old of a step up to the newest checkpoint is a crashed save or the leftover
        # of an interrupted re-save: nothing newer needs it.
        m = _STAGING.match(p.name) or _OLD.match(p.name)
        if m and int(m.group(1)) <= complete[-1][0]:
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


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A rank's seed after a resume that cannot restore its generators: a pure function of (seed, step, rank), so
    every resume of that shape draws the same, and no two ranks draw alike."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:8], "little") >> 1


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
