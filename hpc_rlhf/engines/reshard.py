"""Loading a training-engine checkpoint on another number of ranks (issue 36): DeepSpeed's universal checkpoint.

A ZeRO checkpoint is per rank: under stages 1-3 each rank's file holds its partition of the fp32 master weights and
of Adam's moments, so a role of M ranks cannot read what a role of N ranks wrote. DeepSpeed's own answer is the
universal checkpoint: `deepspeed.checkpoint.ds_to_universal` rewrites the tag folder as one folder per parameter
(`zero/<name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt`, plus the step) and the model-state files, and an engine built
with `checkpoint.load_universal` loads any slice of it. `TrainEngine.load_checkpoint` does this by itself when
the checkpoint's marker names another role size:

    <engine folder>/engine/                      what save_checkpoint wrote (N ranks), untouched
    <engine folder>/ENGINE_COMPLETE.json         {"role_size": N, "zero_stage": ..., "dtype": ..., ...}
    <engine folder>/engine_universal_from_N/     made once by the role leader on the first load on M != N ranks:
        engine/...                               the universal checkpoint (same tag)
        latest_universal                         written by ds_to_universal; we pass the tag instead

The other ranks of the role wait for the folder (or for the leader's note that it failed) on the file system, not in
a collective: a conversion reads and writes the whole optimizer state twice (~12 bytes per parameter each way:
minutes for a 7B model), longer than the collectives' timeout (dist.timeout_s, 300 s by default).

The conversion writes into a hidden temporary folder next to it and renames it into place when it has finished,
so a job killed while converting leaves only a temporary folder, which the next conversion deletes; the final
folder exists only complete. It runs in a child process (`python -m deepspeed.checkpoint.ds_to_universal`): a
fresh interpreter that holds no process group and whose memory (one rank's optimizer shard at a time with one
worker) is returned when it exits.

Stage 0 needs no conversion: DeepSpeed saves the whole model and the optimizer (replicated, not partitioned: torch's
AdamW in fp32, its FP16_Optimizer wrapper with fp32 master weights in bf16/fp16) in one file that any number of
ranks loads as it is.

Frozen parameters (a LoRA engine's base) are not in the universal checkpoint: it restores parameters from the
optimizer's fp32 copies, and frozen ones have none. They are what the engine was built with at the resume (the
base read again from `model.path`, as at the first start), so the checkpoint records a fingerprint of them
(`frozen_fingerprint`: their element count, sum and sum of squares in float64, taken over the role's shards under
ZeRO-3) and a resharded load compares it with the new engine's: another base is refused before anything is read,
naming both figures. A checkpoint without the record (written before it existed) is refused under ZeRO 1-3 as
before. What else cannot be resharded is refused too: another ZeRO stage or dtype than the checkpoint's.

Measured on CPU (tests/engines/test_reshard.py): fp32 ZeRO 0-3 and bf16 ZeRO 0/2/3 saved on 2 ranks continue on 1
and 3 ranks as the uninterrupted run does, and so does a LoRA engine under ZeRO-3 saved on 2 ranks on 1 and 3. fp16 is
untested (DeepSpeed refuses fp16 on CPU); DeepSpeed's universal checkpoint carries its loss scaler
(zero/optimizer_state.pt).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

UNIVERSAL_PREFIX = "engine_universal_from_"
_TMP_INFIX = ".tmp-"
_FAILED_INFIX = ".failed-"


def universal_folder(directory: str | os.PathLike, saved_role_size: int) -> Path:
    """Where the universal copy of the checkpoint in `directory` (saved on `saved_role_size` ranks) lives."""
    return Path(directory) / f"{UNIVERSAL_PREFIX}{saved_role_size}"


def needs_conversion(zero_stage: int) -> bool:
    """Whether a checkpoint of this ZeRO stage must become universal to load on another number of ranks.

    ZeRO-0 keeps the optimizer whole on every rank and DeepSpeed saves it with the model in one file: in fp32
    torch's AdamW as it is, in bf16/fp16 DeepSpeed's FP16_Optimizer wrapper (fp32 master weights and AdamW,
    replicated, not partitioned), so any number of ranks loads it as it is. ZeRO 1-3 partition the master weights
    and moments per rank: yes."""
    return zero_stage > 0


FINGERPRINT_CHUNK = 1 << 24  # elements: a 128 MB float64 temporary at most
FINGERPRINT_RTOL = 1e-9  # far above the rounding of another summation order, far below any retrained weight


def frozen_fingerprint(pieces: list[torch.Tensor]) -> list[float]:
    """[elements, sum, sum of squares] of the frozen parameters' values in `pieces` (whole tensors, or the shards
    of them a rank holds under ZeRO-3: the figures of the shards add up to the whole's), in float64. Summed in
    another order on another number of ranks they move by rounding only (~1e-16 relative), while another base
    moves them at its first differing weight."""
    elements, total, squares = 0, 0.0, 0.0
    for piece in pieces:
        values = piece.detach().reshape(-1)
        elements += values.numel()
        # On the tensor's own device, a slice at a time: a float64 copy of a whole embedding matrix would be
        # four times its bf16 size.
        for chunk in values.split(FINGERPRINT_CHUNK):
            chunk = chunk.to(torch.float64)
            total += float(chunk.sum())
            squares += float(chunk.square().sum())
    return [float(elements), total, squares]


def same_fingerprint(saved: list[float], current: list[float]) -> bool:
    """Whether two fingerprints are of the same values, summed in any order. The sum's rounding grows with the sum
    of the values' magnitudes, not with the sum itself (which cancels): that is bounded by sqrt(elements x sum of
    squares)."""
    (count, total, squares), (count_now, total_now, squares_now) = saved, current
    magnitudes = math.sqrt(count * max(squares, squares_now))
    return (count == count_now and abs(total - total_now) <= FINGERPRINT_RTOL * magnitudes
            and abs(squares - squares_now) <= FINGERPRINT_RTOL * max(squares, squares_now))


def reshard_refusal(marker: dict, role_size: int, zero_stage: int, dtype: torch.dtype,
                    frozen_parameters: list[str], fingerprint: list[float] | None = None) -> str | None:
    """Why a checkpoint with this marker cannot be loaded by an engine on `role_size` ranks (None: it can).
    `fingerprint`: this engine's `frozen_fingerprint`, needed when it has frozen parameters and would reshard."""
    saved = marker.get("role_size")
    head = f"saved on {saved} ranks, loading on {role_size}"
    if marker.get("zero_stage") != zero_stage:
        return (f"saved with train.zero_stage={marker.get('zero_stage')} on {saved} ranks; this engine has "
                f"zero_stage={zero_stage} on {role_size} ranks (the stage must be the same)")
    if saved == role_size:
        return None
    saved_dtype = marker.get("dtype")
    if saved_dtype is not None and saved_dtype != str(dtype).removeprefix("torch."):
        return f"{head}: saved in {saved_dtype}, this engine trains in {dtype} (resharding keeps the dtype)"
    if frozen_parameters and needs_conversion(zero_stage):
        what = f"{len(frozen_parameters)} frozen parameters (e.g. {frozen_parameters[0]}; a LoRA base)"
        recorded = marker.get("frozen_fingerprint")
        if recorded is not None and not _is_fingerprint(recorded):  # the marker is a file of the run folder
            return (f"{head}: the checkpoint's frozen_fingerprint is not [elements, sum, sum of squares] but "
                    f"{str(recorded)[:200]}; resume on {saved} ranks")
        if recorded is None:
            return (f"{head}: this engine has {what}, which DeepSpeed's universal checkpoint does not restore, and "
                    f"the checkpoint has no record of those it trained with (written by an older version); "
                    f"resume on {saved} ranks")
        if fingerprint is None or not same_fingerprint(recorded, fingerprint):
            shown = "not computed" if fingerprint is None else _shown(fingerprint)
            return (f"{head}: this engine's {what} are not those the checkpoint trained with (elements, sum, sum "
                    f"of squares: saved {_shown(recorded)}, now {shown}); resharding keeps them as built, so "
                    f"build the engine from the same base model (model.path) as the run that saved it")
    return None


def _is_fingerprint(value) -> bool:
    return (isinstance(value, list) and len(value) == 3
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))


def _shown(fingerprint: list[float]) -> str:
    return f"{int(fingerprint[0])}, {fingerprint[1]:.10g}, {fingerprint[2]:.10g}"


def convert_to_universal(tag_folder: str | os.PathLike, output: str | os.PathLike, workers: int = 1,
                         timeout_s: float | None = None) -> Path:
    """Convert DeepSpeed's checkpoint in `tag_folder` into a universal checkpoint at `output/<tag>`, atomically:
    written under a temporary sibling and renamed to `output` at the end. An existing `output` is trusted as it
    is (it only ever appears complete). Leftover temporary folders of killed conversions are deleted first.
    Returns `output`. Raises RuntimeError with the converter's output when it fails."""
    tag_folder, output = Path(tag_folder), Path(output)
    if output.is_dir():
        return output
    if not any(tag_folder.glob("*_optim_states.pt")):  # ZeRO 1-3 write one per rank (ZeRO-0 needs no conversion)
        raise FileNotFoundError(f"{tag_folder} holds no ZeRO optimizer shards (*_optim_states.pt) to convert")
    for stale in output.parent.glob(f".{output.name}{_TMP_INFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    temporary = output.parent / f".{output.name}{_TMP_INFIX}{os.getpid()}"
    temporary.mkdir(parents=True)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_folder),
               "--output_folder", str(temporary / tag_folder.name), "--num_extract_workers", str(workers),
               "--num_merge_workers", str(workers), "--inject_missing_state"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"converting {tag_folder} into a universal checkpoint failed (exit "
                               f"{proc.returncode}): {' '.join(command)}\n--- stdout\n{proc.stdout[-3000:]}\n"
                               f"--- stderr\n{proc.stderr[-6000:]}")
        _fsync_tree(temporary)
        temporary.rename(output)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    _fsync_dir(output.parent)
    return output


def failure_note(output: str | os.PathLike, attempt: int) -> Path:
    """The file in which the role leader says that attempt `attempt` to make `output` failed, and why."""
    output = Path(output)
    return output.parent / f".{output.name}{_FAILED_INFIX}{attempt}"


def convert_or_note_failure(tag_folder: str | os.PathLike, output: str | os.PathLike, attempt: int,
                            workers: int = 1) -> Path:
    """The role leader's side: `convert_to_universal`, and on failure a note for the waiting ranks (then raise)."""
    output = Path(output)
    for old in output.parent.glob(f".{output.name}{_FAILED_INFIX}*"):
        if old != failure_note(output, attempt):
            old.unlink(missing_ok=True)
    try:
        return convert_to_universal(tag_folder, output, workers=workers)
    except BaseException as error:
        note = failure_note(output, attempt)
        # Written whole, then renamed into place: a waiting rank that saw the name must read the whole text (it read
        # an empty note once, in a loaded fresh-clone suite).
        written = note.parent / f".tmp-{note.name}"
        written.write_text(f"{type(error).__name__}: {error}"[-4000:])
        written.replace(note)
        raise


def wait_for_conversion(output: str | os.PathLike, attempt: int, timeout_s: float | None = None,
                        poll_s: float = 0.5) -> Path:
    """The other ranks' side: wait until `output` exists (the leader renamed it into place) or the leader's failure
    note of this attempt does (RuntimeError with its text). `timeout_s` None: as long as it takes (a leader that
    dies takes the job down with it: the launchers stop every rank when one fails)."""
    output = Path(output)
    note = failure_note(output, attempt)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if output.is_dir():
            return output
        if note.is_file():
            raise RuntimeError(f"the role leader failed to convert the checkpoint into {output}: {note.read_text()}")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for the role leader to convert the checkpoint into {output}")
        time.sleep(poll_s)
        _refresh(output.parent)


def _refresh(folder: Path) -> None:
    # Listing the folder makes network file systems (NFS attribute caches) look again rather than answer from cache.
    try:
        os.listdir(folder)
    except OSError:
        pass


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
