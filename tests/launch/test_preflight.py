"""hpc_rlhf/launch/preflight.py: the in-job check of the real files names the key of the first problem (a model
folder without weights, a tokenizer folder without tokenizer files, a data row that is not an object, an
output_dir without room for what the run writes there). Through the sbatch scripts:
tests/launch/test_sbatch_scripts.py."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from hpc_rlhf.config import TINY_ASSETS, load_config
from hpc_rlhf.dist.allocation import AllocationError
from hpc_rlhf.launch import preflight
from hpc_rlhf.launch.dry_run import check_config, checkpoint_per_node_gb
from hpc_rlhf.rl import ppo
from hpc_rlhf.trainers import sft

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / TINY_ASSETS / "models" / "llama-tiny"
DATA = REPO / TINY_ASSETS / "data"


def tiny_ppo(tmp_path: Path, *extra: str):
    cfg = load_config(ppo.Config, REPO / "examples" / "tiny" / "ppo.yaml",
                      [f"actor.path={MODEL}", f"critic.path={MODEL}", f"reward.models=[{MODEL}]",
                       f"output_dir={tmp_path / 'out'}", *extra])
    return cfg, check_config("ppo", cfg, 6, 2, gpu_memory_gb=1000)


def test_every_folder_and_file_the_run_reads_is_checked(tmp_path):
    cfg, report = tiny_ppo(tmp_path)
    lines = preflight.check_files(cfg, report, sum(checkpoint_per_node_gb(report)))
    keys = [line.split(":", 1)[0] for line in lines]
    # the folders, the policy's tokenizer, the reward model's tokenizer against it, the data, the output
    assert keys == ["actor.path", "critic.path", "reward.models[0]", "actor.path", "reward.models[0]",
                    "data.train_files", "data.eval_files", "output_dir"]
    assert f"reward.models[0]: the same tokenizer as actor.path ({MODEL})" in lines
    assert (tmp_path / "out").is_dir()  # made, and nothing left in it
    assert list((tmp_path / "out").iterdir()) == []


def test_the_data_keys_are_found_in_every_section():
    cfg = load_config(sft.Config, REPO / "examples" / "tiny" / "sft.yaml")
    assert {"data.train_files", "data.eval_files", "eval.prompt_files"} <= set(preflight.data_files(cfg))


def test_a_model_folder_without_weights_names_its_key(tmp_path):
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(MODEL / "config.json", folder)
    cfg, report = tiny_ppo(tmp_path, f"critic.path={folder}")
    with pytest.raises(AllocationError, match=r"critic\.path: model folder '.*no_weights' has a config.json but no "
                                              r"weights"):
        preflight.check_files(cfg, report, 0.0)


def test_a_tokenizer_folder_without_tokenizer_files_names_its_key(tmp_path):
    cfg, report = tiny_ppo(tmp_path, f"actor.tokenizer={tmp_path}")
    with pytest.raises(AllocationError, match=r"actor\.tokenizer: tokenizer folder .* has no tokenizer files"):
        preflight.check_files(cfg, report, 0.0)


@pytest.mark.parametrize("text, says", [
    ('{"prompt": "a"}\n["a list"]\n', "line 2: a row must be a JSON object, got list"),
    ('{"prompt": "a"}\n\n{"prompt": \n', "line 3: malformed JSON"),
    ("\n\n", "is empty"),
])
def test_the_first_rows_of_a_data_file_must_be_json_objects(tmp_path, text, says):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(text)
    cfg, report = tiny_ppo(tmp_path, f"data.eval_files=[{rows}]")
    with pytest.raises(AllocationError, match=rf"data\.eval_files: .*{says}"):
        preflight.check_files(cfg, report, 0.0)


def test_an_output_dir_without_room_for_the_checkpoints_kept_and_the_next_is_refused(tmp_path, monkeypatch):
    cfg, report = tiny_ppo(tmp_path)  # checkpoint.keep=2: three checkpoints at once, then final/
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _: usage(100e9, 95e9, 5e9))
    preflight.check_files(cfg, report, 1.6)  # 4.8 GB and the tiny final/: fits in 5
    with pytest.raises(AllocationError, match=r"output_dir: .* has 5.0 GB free, but the run writes about 6.0 GB "
                                              r"there at its fullest \(3 checkpoints \(checkpoint.keep=2 and the "
                                              r"next\) of 2.0 GB; final/ 0.0 GB\)"):
        preflight.check_files(cfg, report, 2.0)


def test_the_room_counts_the_hugging_face_copies_and_best(tmp_path):
    cfg, report = tiny_ppo(tmp_path, "checkpoint.keep=1", "checkpoint.every_steps=5", "checkpoint.save_hf=true",
                           "checkpoint.best_metric=eval_accuracy", "actor.dtype=float32", "critic.dtype=float32")
    roles = report["roles"]
    # a trained role's model_gb is its whole model as a Hugging Face folder writes it: the tiny model's weights file
    # (fp32; the default dtype counts bfloat16, as on a GPU)
    weights_gb = (MODEL / "model.safetensors").stat().st_size / 1e9
    assert roles["actor"]["model_gb"] == pytest.approx(weights_gb, rel=0.02)
    models = roles["actor"]["model_gb"] + roles["critic"]["model_gb"]  # the two trained roles; ref, reward: not
    need = preflight.output_dir_need(cfg, report, 1.0)
    assert [gb for _, gb in need] == pytest.approx([2 * (1.0 + models), models, 2 * roles["actor"]["model_gb"]])
    assert "checkpoint.save_hf" in need[0][0] and "checkpoint.best_metric" in need[2][0]
    # without every_steps the checkpoints hold no Hugging Face folders (only a stop's, which has none), nor best/
    cfg, report = tiny_ppo(tmp_path, "checkpoint.keep=1", "checkpoint.save_hf=true", "actor.dtype=float32",
                           "critic.dtype=float32")
    assert [gb for _, gb in preflight.output_dir_need(cfg, report, 1.0)] == pytest.approx([2.0, models])


def test_a_knowledge_distillation_teacher_is_checked_for_weights_the_students_tokenizer_and_width(tmp_path):
    from hpc_rlhf.trainers import kd

    def kd_run(teacher: Path):
        cfg = load_config(kd.Config, REPO / "examples" / "tiny" / "kd.yaml",
                          [f"model.path={MODEL}", f"kd.teacher={teacher}", f"output_dir={tmp_path / 'out'}",
                           "train.micro_batch_size=64", "dist.nproc=2"])
        return cfg, check_config("kd", cfg, 2, 2, gpu_memory_gb=1000)

    cfg, report = kd_run(MODEL)
    keys = [line.split(":", 1)[0] for line in preflight.check_files(cfg, report, 0.0)]
    assert keys[:3] == ["model.path", "kd.teacher", "model.path"] and "kd.teacher" in keys[3:]
    other = tmp_path / "teacher"  # two digits' ids swapped in its tokenizer
    shutil.copytree(MODEL, other)
    spec = (other / "tokenizer.json").read_text().replace('"0": ', '"zero": ').replace('"1": ', '"0": ')
    (other / "tokenizer.json").write_text(spec.replace('"zero": ', '"1": '))
    cfg, report = kd_run(other)
    with pytest.raises(AllocationError, match=r"kd\.teacher: kd\.teacher '.*teacher' does not share the tokenizer"):
        preflight.check_files(cfg, report, 0.0)
    wider = tmp_path / "wider"  # the student's tokenizer, an output layer of another width
    shutil.copytree(MODEL, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 24}))
    cfg, report = kd_run(wider)
    with pytest.raises(AllocationError, match=r"kd\.teacher: kd\.teacher '.*wider' has \d+ output tokens"):
        preflight.check_files(cfg, report, 0.0)


def test_a_reward_model_must_share_the_policys_tokenizer_when_it_has_one(tmp_path):
    """It scores the policy's token ids. A reward model folder without tokenizer files cannot be compared: said, and
    passed."""
    other = tmp_path / "rm"  # two digits' ids swapped in its tokenizer
    shutil.copytree(MODEL, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["vocab"]["0"], spec["model"]["vocab"]["1"] = spec["model"]["vocab"]["1"], spec["model"]["vocab"]["0"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    cfg, report = tiny_ppo(tmp_path, f"reward.models=[{other}]")
    with pytest.raises(AllocationError, match=r"reward\.models\[0\]: reward\.models\[0\] '.*rm' does not share the "
                                              r"tokenizer of actor\.path .*a reward model scores the policy's token"):
        preflight.check_files(cfg, report, 0.0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).unlink()
    cfg, report = tiny_ppo(tmp_path, f"reward.models=[{other}]")
    lines = preflight.check_files(cfg, report, 0.0)
    assert "reward.models[0]: no tokenizer files beside the model, not compared with actor.path's" in lines
