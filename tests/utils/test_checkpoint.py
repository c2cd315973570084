import os

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
    checkpointing.restore_rng(SimpleNamespace(rank=0), folder)
    assert not (tmp_path / "ran").exists()
    assert "not plain tensors and numbers" in caplog.text
