"""The in-job check of the real files (`--dry-run --check-files`, which sbatch/common.sh runs before any rank
starts): a typo or a leftover placeholder ends the job in seconds, with one line naming the key, instead of after
every rank has loaded its model.

- model folders: every folder the plan read (`report["model_folders"]`: actor.path, critic.path, reward.models[i],
  model.path, ...) holds a config.json and weights whose safetensors headers read, and the tokenizer folder
  (`actor.tokenizer` or `model.tokenizer`, else the model folder) has tokenizer files; a teacher to distill from
  (distill.teacher, kd.teacher) has the same tokenizer;
- data files: every `*_files` key (data.train_files, data.eval_files, eval.prompt_files, ...) names files or
  folders that exist; the first PEEK_ROWS rows of a JSON or JSON Lines file parse as JSON objects (the trainer
  checks every row against its mode's keys when it loads them);
- output_dir: can be created and written, and its file system has room for what the run writes there at its
  fullest (`output_dir_need`): checkpoint.keep checkpoints and the next one (it is complete before the oldest
  goes; each with every trained role's weights and optimizer states, the plan's estimate, and its Hugging Face
  folders under checkpoint.save_hf), final/, and best/ with a better model staged beside it
  (checkpoint.best_metric).

A login-node dry run leaves this out: the folders there may be placeholders (sized by `--model`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from hpc_rlhf.dist.allocation import AllocationError
from hpc_rlhf.models.folders import (ModelFolderError, check_model_folder, same_tokenizer_files,
                                     tokenizer_folder_problem)

PEEK_ROWS = 5


def check_files(cfg: Any, report: dict, checkpoint_gb: float) -> list[str]:
    """Check the folders and files the run will read and the folder it writes (`checkpoint_gb`: one checkpoint of
    the trained roles' states, all nodes together); returns one line per thing checked (for the job log). Raises
    AllocationError naming the key of the first problem."""
    checked = [_check_model_folder(key, folder) for key, folder in report["model_folders"].items()]
    checked += [_check_tokenizer(key, folder) for key, folder in tokenizer_folders(cfg).items()]
    for key, scorer in token_id_scorers(cfg).items():
        checked.append(_check_scorer_tokenizer(cfg, key, scorer))
    for key, paths in data_files(cfg).items():
        checked += [_check_data_file(key, Path(path)) for path in paths]
    checked.append(_check_output_dir(cfg.output_dir, output_dir_need(cfg, report, checkpoint_gb)))
    return checked


def tokenizer_folders(cfg: Any) -> dict[str, str]:
    """key -> the tokenizer folder the run loads (its own key when set, else the model folder's)."""
    section, name = (cfg.actor, "actor") if hasattr(cfg, "actor") else (cfg.model, "model")
    if section.tokenizer:
        return {f"{name}.tokenizer": section.tokenizer}
    return {f"{name}.path": section.path}


def data_files(cfg: Any, prefix: str = "") -> dict[str, list[str]]:
    """Every `*_files` key of the config (a list of paths), by its dotted name."""
    found = {}
    for spec in dataclasses.fields(cfg):
        value, key = getattr(cfg, spec.name), f"{prefix}{spec.name}"
        if dataclasses.is_dataclass(value):
            found |= data_files(value, f"{key}.")
        elif spec.name.endswith("_files") and isinstance(value, (list, tuple)):
            found[key] = [str(v) for v in value]
    return found


def _check_model_folder(key: str, folder: str) -> str:
    if not Path(folder).exists():
        raise AllocationError(key, f"model folder '{folder}' does not exist (a placeholder, or a typo?); compute nodes "
                                   f"cannot download from the hub")
    try:
        check_model_folder(folder)
    except ModelFolderError as exc:
        raise AllocationError(key, str(exc)) from None
    return f"{key}: model folder {folder}"


def _check_tokenizer(key: str, folder: str) -> str:
    path = Path(folder)
    if not path.is_dir():
        raise AllocationError(key, f"tokenizer folder '{folder}' does not exist")
    problem = tokenizer_folder_problem(path)
    if problem:
        raise AllocationError(key, problem)
    return f"{key}: tokenizer in {folder}"


def token_id_scorers(cfg: Any) -> dict[str, str]:
    """key -> each folder that scores the policy's token ids and so must share its tokenizer: the teacher a run
    distills from (RL's `distill.teacher`, knowledge distillation's `kd.teacher`) and each reward model (RL's
    `reward.models`, the `score.reward_models` of generate, rs, idpo and csft)."""
    found = {}
    for section in ("distill", "kd"):
        teacher = getattr(getattr(cfg, section, None), "teacher", None)
        if teacher:
            found[f"{section}.teacher"] = teacher
    for section, key in (("reward", "models"), ("score", "reward_models")):
        for index, path in enumerate(getattr(getattr(cfg, section, None), key, None) or []):
            found[f"{section}.{key}[{index}]"] = path
    return found


def _check_scorer_tokenizer(cfg: Any, teacher_key: str, teacher: str) -> str:
    """The teacher or reward model shares the policy's tokenizer; knowledge distillation's teacher (`kd.teacher`),
    which compares whole next-token distributions, also the width of the student's output layer."""
    [(key, folder)] = tokenizer_folders(cfg).items()
    same = f"{teacher_key}: the same tokenizer as {key} ({folder})"
    reward_model = teacher_key.startswith(("reward.", "score."))
    if reward_model and tokenizer_folder_problem(Path(teacher)) is not None:
        return f"{teacher_key}: no tokenizer files beside the model, not compared with {key}'s"
    if reward_model and same_tokenizer_files(folder, teacher):
        return same  # the usual case (a reward model trained from the policy's model), without transformers
    # transformers (~4 CPU-s of imports): only a teacher's check, or a reward model's whose files differ, loads it
    from hpc_rlhf.models.builders import (reward_model_tokenizer_problem, same_output_width_problem,
                                          same_tokenizer_problem)

    if reward_model:
        problem = reward_model_tokenizer_problem(folder, teacher, key, teacher_key)
    else:
        problem = same_tokenizer_problem(folder, teacher, key, teacher_key)
    if not problem and teacher_key == "kd.teacher":
        problem = same_output_width_problem(cfg.model.path, teacher, "model.path", teacher_key)
    if problem:
        raise AllocationError(teacher_key, problem)
    return same


def _json_rows(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the first PEEK_ROWS non-blank lines (a whole-file JSON array: its first line only)."""
    seen = 0
    with open(path, encoding="utf-8", errors="strict") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, line
                seen += 1
                if seen == PEEK_ROWS:
                    return


def _check_data_file(key: str, path: Path) -> str:
    if not path.exists():
        raise AllocationError(key, f"'{path}' does not exist")
    if path.is_dir() or path.suffix not in (".jsonl", ".json"):
        return f"{key}: {path}"  # parquet, csv, save_to_disk folders: read whole when the run loads them
    try:
        rows = list(_json_rows(path))
    except UnicodeDecodeError as exc:
        raise AllocationError(key, f"'{path}' is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not rows:
        raise AllocationError(key, f"'{path}' is empty (no rows)")
    if rows[0][1].lstrip().startswith("[") and path.suffix == ".json":
        return f"{key}: {path} (a JSON array, read whole when the run loads it)"
    for number, line in rows:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AllocationError(key, f"'{path}', line {number}: malformed JSON ({exc.msg}, column {exc.colno})") \
                from None
        if not isinstance(row, dict):
            raise AllocationError(key, f"'{path}', line {number}: a row must be a JSON object, got "
                                       f"{type(row).__name__}")
    return f"{key}: {path} (first {len(rows)} rows parse)"


def check_output_dir_writable(output_dir: str) -> Path:
    """Make `output_dir` (as the run would) and write a file in it; AllocationError naming the key when either
    fails. The command line runs it before any rank starts, so a run folder that cannot be written is one line, not
    rank 0's traceback."""
    folder = Path(output_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise AllocationError("output_dir", f"'{folder}' cannot be created or written: "
                                            f"{exc.strerror or exc}") from None
    return folder


def output_dir_need(cfg: Any, report: dict, checkpoint_gb: float) -> list[tuple[str, float]]:
    """What the run writes into output_dir at its fullest, as (what, GB) parts: checkpoint.keep checkpoints and the
    one being written (`checkpoint_gb` each, plus the trained models' Hugging Face folders under
    checkpoint.save_hf), final/ (every trained model), and best/ twice (checkpoint.best_metric: a better actor is
    written beside the kept one before it replaces it). A sum of the peaks, so a little more than any one moment."""
    trained = [row for row in report["roles"].values()
               if row["breakdown_gb"].get("optimizer", 0.0) + row["breakdown_gb"].get("cpu_optimizer", 0.0) > 0]
    ckpt = getattr(cfg, "checkpoint", None)
    if ckpt is None or not trained:
        return []
    models_gb = sum(row["model_gb"] for row in trained)
    hf = ckpt.save_hf and ckpt.every_steps > 0
    each = checkpoint_gb + (models_gb if hf else 0.0)
    parts = [(f"{ckpt.keep + 1} checkpoints (checkpoint.keep={ckpt.keep} and the next) of {each:,.1f} GB"
              + (f", their Hugging Face folders (checkpoint.save_hf) {models_gb:,.1f} GB of it" if hf else ""),
              (ckpt.keep + 1) * each),
             (f"final/ {models_gb:,.1f} GB", models_gb)]
    if ckpt.best_metric:
        actor_gb = report["roles"]["actor"]["model_gb"]
        parts.append((f"best/ and a better model staged beside it (checkpoint.best_metric) 2 x {actor_gb:,.1f} GB",
                      2 * actor_gb))
    return parts


def _check_output_dir(output_dir: str, need: list[tuple[str, float]]) -> str:
    folder = check_output_dir_writable(output_dir)
    free_gb = shutil.disk_usage(folder).free / 1e9
    need_gb = sum(gb for _, gb in need)
    parts = "; ".join(what for what, _ in need) or "nothing trained"
    if free_gb < need_gb:
        raise AllocationError("output_dir", f"'{folder}' has {free_gb:,.1f} GB free, but the run writes about "
                                            f"{need_gb:,.1f} GB there at its fullest ({parts}): free space, lower "
                                            f"checkpoint.keep or choose another file system")
    return f"output_dir: {folder} writable, {free_gb:,.0f} GB free (the run's fullest: ~{need_gb:,.1f} GB; {parts})"
