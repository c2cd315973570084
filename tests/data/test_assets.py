import filecmp
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pytest
from transformers import AutoConfig, AutoTokenizer

from hpc_rlhf.data import assets
from hpc_rlhf.models import tiny
from tests.distributed import REPO, worker_env

DATA_COLUMNS = {
    "sft_train.jsonl": ["prompt", "response"],
    "sft_eval.jsonl": ["prompt", "response"],
    "pref_train.jsonl": ["prompt", "chosen", "rejected"],
    "pref_eval.jsonl": ["prompt", "chosen", "rejected"],
    "kto_train.jsonl": ["prompt", "completion", "label"],
    "kto_eval.jsonl": ["prompt", "completion", "label"],
    "prm_train.jsonl": ["input", "label"],
    "prm_eval.jsonl": ["input", "label"],
    "prompts_train.jsonl": ["prompt", "answer"],
    "prompts_eval.jsonl": ["prompt", "answer"],
    "chat_train.jsonl": ["messages"],
    "sft_tool_train.jsonl": ["prompt", "response"],
}


def all_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("assets") / "tiny"
    assert assets.main(["--out", str(out), "--seed", "0"]) == 0
    return out


def test_layout_and_manifest(generated):
    files = all_files(generated)
    assert "MANIFEST.json" in files
    assert all(f"data/{name}" in files for name in DATA_COLUMNS)
    for name in tiny.MODEL_NAMES:
        assert {f"models/{name}/config.json", f"models/{name}/model.safetensors",
                f"models/{name}/tokenizer.json"} <= set(files)
    manifest = json.loads((generated / "MANIFEST.json").read_text())
    assert manifest["seed"] == 0 and manifest["version"] == assets.ASSETS_VERSION
    assert manifest["counts"]["data/sft_train.jsonl"] == 9500
    assert manifest["counts"]["data/sft_eval.jsonl"] == 500
    assert AutoTokenizer.from_pretrained(generated / "tokenizer").eos_token_id == 2
    for name in tiny.MODEL_NAMES:
        assert AutoConfig.from_pretrained(generated / "models" / name).vocab_size == 104


def test_same_seed_gives_identical_files(generated, tmp_path):
    again = assets.generate(tmp_path / "again", seed=0)
    assert all_files(again) == all_files(generated)
    for name in all_files(generated):
        assert filecmp.cmp(generated / name, again / name, shallow=False), name


def test_load_dataset_reads_every_file(generated, tmp_path):
    manifest = json.loads((generated / "MANIFEST.json").read_text())
    for name, columns in DATA_COLUMNS.items():
        rows = datasets.load_dataset("json", data_files=str(generated / "data" / name), split="train",
                                     cache_dir=str(tmp_path / "cache"))
        assert rows.column_names == columns, name
        assert rows.num_rows == manifest["counts"][f"data/{name}"], name
    kto = datasets.load_dataset("json", data_files=str(generated / "data" / "kto_train.jsonl"), split="train",
                                cache_dir=str(tmp_path / "cache"))
    assert kto.features["label"].dtype == "bool"


def test_held_out_answers_are_correct_and_training_ones_are_not_all(generated):
    def read(name):
        return [json.loads(line) for line in (generated / "data" / name).read_text().splitlines()]

    def right(row, key):
        a, b = row["prompt"].rstrip("=").split("+")
        return row[key] == str(int(a) + int(b))

    assert all(right(row, "response") for row in read("sft_eval.jsonl"))
    wrong_share = 1 - sum(right(row, "response") for row in read("sft_train.jsonl")) / 9500
    assert 0.2 < wrong_share < 0.35  # 60% of the ~45% of problems that carry
    train_prompts = {row["prompt"] for row in read("prompts_train.jsonl")}
    assert not train_prompts & {row["prompt"] for row in read("prompts_eval.jsonl")}


def test_second_run_does_nothing(generated, monkeypatch, capsys):
    before = {name: (generated / name).stat().st_mtime_ns for name in all_files(generated)}
    monkeypatch.setattr(assets, "generate", lambda *a, **k: pytest.fail("up-to-date assets were rebuilt"))
    assert assets.main(["--out", str(generated), "--seed", "0"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert assets.ensure_assets(generated, seed=5) == generated  # complete assets of another seed are kept
    assert {name: (generated / name).stat().st_mtime_ns for name in all_files(generated)} == before


def test_other_seed_force_and_stale_version_regenerate(generated, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(assets, "generate", lambda out, seed=0: calls.append(seed) or Path(out))
    assert assets.main(["--out", str(generated), "--seed", "1"]) == 0
    assert assets.main(["--out", str(generated), "--seed", "0", "--force"]) == 0
    stale = tmp_path / "stale"
    stale.mkdir()
    manifest = json.loads((generated / "MANIFEST.json").read_text())
    (stale / "MANIFEST.json").write_text(json.dumps({**manifest, "version": 0}))
    assets.ensure_assets(stale)
    assert calls == [1, 0, 0]


def test_force_replaces_the_folder_with_identical_content(generated, tmp_path):
    copy = shutil.copytree(generated, tmp_path / "copy")
    (copy / "data" / "extra.txt").write_text("left over")
    assert assets.main(["--out", str(copy), "--force"]) == 0
    assert all_files(copy) == all_files(generated)
    assert filecmp.cmp(copy / "data" / "sft_train.jsonl", generated / "data" / "sft_train.jsonl", shallow=False)
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]  # no staging or retired folders left behind


def test_failure_midway_leaves_no_folder_and_keeps_the_old_one(generated, tmp_path, monkeypatch):
    real_write = assets.write_jsonl
    written = []

    def failing_write(path, rows):
        if len(written) == 3:
            raise OSError("disk full")
        written.append(path)
        return real_write(path, rows)

    monkeypatch.setattr(assets, "write_jsonl", failing_write)
    with pytest.raises(OSError, match="disk full"):
        assets.main(["--out", str(tmp_path / "new")])
    assert list(tmp_path.iterdir()) == []

    old = shutil.copytree(generated, tmp_path / "old")
    written.clear()
    with pytest.raises(OSError, match="disk full"):
        assets.main(["--out", str(old), "--force"])
    assert assets.is_up_to_date(old, seed=0)
    assert all_files(old) == all_files(generated)
    assert [p.name for p in tmp_path.iterdir()] == ["old"]


# The models are stubbed out so that the child does not spend seconds importing torch: what is tested is
# where files land when the process dies, which does not depend on what the files hold.
KILLED_MIDWAY = textwrap.dedent("""
    import os, signal, sys
    from hpc_rlhf.data import assets
    def stub_model_folder(name, out_dir, seed=0):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
    assets.tiny.make_model_folder = stub_model_folder
    real_write = assets.write_jsonl
    def write_then_die(path, rows):
        real_write(path, rows)
        if path.name == "pref_train.jsonl":
            os.kill(os.getpid(), signal.SIGKILL)
    assets.write_jsonl = write_then_die
    assets.main(["--out", sys.argv[1]])
""")


def test_killed_run_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, str(out)], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tiny.tmp-")
    assert (leftovers[0] / "data" / "pref_train.jsonl").is_file()  # it did get that far
    assert not (leftovers[0] / "MANIFEST.json").exists()
    # The next caller builds complete assets in the intended place.
    assert assets.ensure_assets(out) == out and assets.is_up_to_date(out, seed=0)


def test_foreign_folder_is_never_replaced(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    assert assets.main(["--out", str(folder)]) == 2
    assert f"{folder} exists and is not an assets folder" in capsys.readouterr().err
    assert (folder / "notes.txt").read_text() == "keep me"
    with pytest.raises(FileExistsError, match="has no MANIFEST.json"):
        assets.ensure_assets(folder)
    # Not even with --force: `--out . --force` must not delete a working copy.
    assert assets.main(["--out", str(folder), "--force"]) == 2
    assert (folder / "notes.txt").read_text() == "keep me"
    # An empty folder (made by hand or by a job script) is simply filled.
    (tmp_path / "empty").mkdir()
    assert assets.main(["--out", str(tmp_path / "empty")]) == 0
    assert assets.is_up_to_date(tmp_path / "empty", seed=0)


def test_source_fingerprint_follows_the_committed_files(monkeypatch, tmp_path):
    shutil.copytree(tiny.TINY_DIR, tmp_path / "hpc_rlhf" / "models" / "tiny")
    monkeypatch.setattr(tiny, "TINY_DIR", tmp_path / "hpc_rlhf" / "models" / "tiny")
    before = assets.source_fingerprint()
    config = tmp_path / "hpc_rlhf" / "models" / "tiny" / "llama-tiny.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    assert assets.source_fingerprint() != before
