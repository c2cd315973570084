import json
import os

import pytest
import torch

from hpc_rlhf.utils import checkpoint as ck


def save(out, step, payload=b"x" * 100, keep=None):
    staging = ck.prepare_staging(out, step)
    (staging / "model.bin").write_bytes(payload)
    (staging / "sub").mkdir()
    (staging / "sub" / "state.json").write_text('{"a": 1}')
    return ck.commit(out, step, meta={"note": "t"}, keep=keep)


def test_commit_makes_a_complete_checkpoint(tmp_path):
    path = save(tmp_path, 5)
    assert path.name == "step_000000005" and ck.verify(path) is None
    assert ck.latest_complete(tmp_path) == (5, path)
    assert not ck.staging_dir(tmp_path, 5).exists()


def test_unfinished_save_is_ignored_and_previous_used(tmp_path):
    save(tmp_path, 5)
    staging = ck.prepare_staging(tmp_path, 10)  # killed before commit
    (staging / "model.bin").write_bytes(b"partial")
    assert ck.latest_complete(tmp_path)[0] == 5


def test_truncated_or_missing_file_is_detected_and_skipped(tmp_path, caplog):
    save(tmp_path, 5)
    newer = save(tmp_path, 10)
    with open(newer / "model.bin", "r+b") as fh:
        fh.truncate(10)
    assert "has 10 bytes, expected 100" in ck.verify(newer)
    assert ck.latest_complete(tmp_path)[0] == 5
    assert "skipping incomplete or corrupt checkpoint" in caplog.text
    os.remove(tmp_path / "checkpoints" / "step_000000005" / "sub" / "state.json")
    assert ck.latest_complete(tmp_path) is None


def test_keep_prunes_oldest_and_stale_staging(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    ck.prepare_staging(tmp_path, 2)
    save(tmp_path, 4, keep=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert not ck.staging_dir(tmp_path, 2).exists()


def test_resaving_same_step_replaces_it(tmp_path):
    save(tmp_path, 7, payload=b"a" * 10)
    path = save(tmp_path, 7, payload=b"b" * 20)
    assert (path / "model.bin").read_bytes() == b"b" * 20 and ck.verify(path) is None


def test_rng_state_round_trip():
    state = ck.rng_state()
    a = torch.rand(3)
    ck.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_the_rng_state_is_plain_data_that_loads_without_running_code(tmp_path):
    """Saved and read back with torch.load(weights_only=True), as a resume reads it: python's, numpy's and torch's
    generators draw again what they drew after the save."""
    import random

    import numpy as np

    torch.save(ck.rng_state(), tmp_path / "rng.pt")
    drawn = (random.random(), float(np.random.rand()), torch.rand(2))
    ck.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), float(np.random.rand()), torch.rand(2))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_a_pickled_object_in_the_rng_file_is_not_run_on_resume(tmp_path, caplog):
    """A file in the run folder is not trusted: one that needs code to load is refused with a warning, and the
    resume goes on without it (not bit for bit)."""
    from types import SimpleNamespace

    from hpc_rlhf.runtime import checkpointing

    class Planted:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    folder = tmp_path / "step_000000003"
    (folder / "rng").mkdir(parents=True)
    torch.save({"python": Planted()}, folder / "rng" / "rank00000.pt")
    checkpointing.restore_rng(SimpleNamespace(rank=0, world_size=1, cfg=SimpleNamespace()), folder, 3)
    assert not (tmp_path / "ran").exists()
    assert "not plain tensors and numbers" in caplog.text and "derived from the seed 0 and step 3" in caplog.text


# ------------------------------------------------------------------------------------------------ re-saving a step
class Killed(BaseException):
    """The process dies here (BaseException: nothing in commit may catch it)."""


def kill_at(monkeypatch, point):
    """Make the `point`-th rename or folder removal of the file-system steps die; a removal dies halfway (after
    deleting the folder's largest file), as a killed rmtree does."""
    calls = [0]
    real_replace, real_rmtree = os.replace, ck.shutil.rmtree

    def step():
        calls[0] += 1
        return calls[0] == point

    def replace(src, dst):
        if step():
            raise Killed
        real_replace(src, dst)

    def rmtree(path, ignore_errors=False):
        if step():
            files = sorted((p for p in ck.Path(path).rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
            if files:
                files[0].unlink()
            raise Killed
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ck.os, "replace", replace)
    monkeypatch.setattr(ck.shutil, "rmtree", rmtree)


# The file-system steps of commit re-saving a step, in order: remove a leftover step_N.old, rename the marker into
# place, step_N -> step_N.old, staging -> step_N, remove step_N.old.
@pytest.mark.parametrize("point", [1, 2, 3, 4, 5])
def test_a_kill_at_any_point_of_resaving_a_step_leaves_one_that_verifies(tmp_path, monkeypatch, point):
    """With checkpoint.keep=1 the step being saved again is the only checkpoint: whichever step of the swap a kill
    interrupts, a resume finds a folder of that step that verifies (step_N, the sealed staging folder or
    step_N.old), and the next save clears the leftovers."""
    save(tmp_path, 7, payload=b"a" * 100, keep=1)
    staging = ck.prepare_staging(tmp_path, 7)
    (staging / "model.bin").write_bytes(b"b" * 100)
    with monkeypatch.context() as patched:
        kill_at(patched, point)
        with pytest.raises(Killed):
            ck.commit(tmp_path, 7, keep=1)
    step, path = ck.latest_complete(tmp_path)
    assert step == 7 and ck.verify(path) is None
    assert (path / "model.bin").read_bytes() in (b"a" * 100, b"b" * 100)
    save(tmp_path, 8, keep=1)
    assert sorted(p.name for p in ck.checkpoints_root(tmp_path).iterdir()) == ["step_000000008"]


def test_a_kill_between_the_renames_resumes_from_the_sealed_staging_folder(tmp_path, monkeypatch):
    """The newer of the two copies is used: the sealed staging folder comes before step_N.old."""
    save(tmp_path, 7, payload=b"a" * 100)
    staging = ck.prepare_staging(tmp_path, 7)
    (staging / "model.bin").write_bytes(b"b" * 100)
    with monkeypatch.context() as patched:
        kill_at(patched, 4)
        with pytest.raises(Killed):
            ck.commit(tmp_path, 7)
    assert [p.name for _, p in ck.candidates(tmp_path)] == [".staging-step_000000007", "step_000000007.old"]
    assert ck.latest_complete(tmp_path) == (7, staging)


# ------------------------------------------------------------------------------------------------ checksums, fsync
def flip_a_byte(path, offset=50):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_byte_fails_verification_and_an_older_checkpoint_is_used(tmp_path, caplog):
    save(tmp_path, 5)
    newer = save(tmp_path, 10)
    flip_a_byte(newer / "model.bin")
    assert ck.verify(newer) == f"{newer}: file model.bin does not match its crc32 checksum (changed)"
    assert ck.verify(newer, names=["sub/state.json"]) is None  # a rank checks its share only
    assert ck.latest_complete(tmp_path)[0] == 5
    assert "model.bin does not match" in caplog.text


def test_a_checkpoint_without_checksums_is_checked_by_size(tmp_path):
    """What an older hpc_rlhf wrote (sizes only) still loads; a truncated file is still found."""
    path = save(tmp_path, 5)
    marker = json.loads((path / ck.MARKER).read_text())
    del marker["checksums"], marker["checksum"]
    (path / ck.MARKER).write_text(json.dumps(marker))
    flip_a_byte(path / "model.bin")
    assert ck.verify(path) is None
    with open(path / "model.bin", "r+b") as fh:
        fh.truncate(10)
    assert "has 10 bytes, expected 100" in ck.verify(path)


def test_every_file_and_folder_is_fsynced_before_the_marker_exists(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, (ck.staging_dir(tmp_path, 5) / ck.MARKER).exists()))
        real_fsync(fd)

    monkeypatch.setattr(ck.os, "fsync", fsync)
    final = save(tmp_path, 5)
    before_marker = {path for path, marker_there in synced if not marker_there}
    staging = str(ck.staging_dir(tmp_path, 5))
    assert {staging + "/model.bin", staging + "/sub/state.json", staging + "/sub", staging} <= before_marker
    assert str(final.parent) in {path for path, _ in synced}  # the rename into place


def test_the_ranks_shares_cover_every_file_once_and_balance_the_bytes():
    files = {"big": 100, "mid": 60, "small": 40, "tiny": 1}
    shares = [ck.share(files, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files)
    assert shares == [["big", "tiny"], ["mid", "small"]]
