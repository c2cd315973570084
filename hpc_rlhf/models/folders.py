"""What a model or tokenizer folder must hold before anything loads it: config.json and whole weight files, a
tokenizer's files that parse. Reads file names, JSON and the safetensors headers only, and imports no torch, so
that `hpc-rlhf MODE --dry-run --check-files` checks the folders of a job in its Slurm batch step in a second.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rlhf.config import ConfigError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")
# Files that hold a tokenizer's vocabulary (fast tokenizers, sentencepiece, BPE, WordPiece); tokenizer_config.json
# alone is not a tokenizer.
TOKENIZER_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


class ModelFolderError(ConfigError):
    """A model or tokenizer folder that cannot be used, naming the folder and what is wrong with it."""


def check_model_folder(path: str | Path) -> Path:
    """The folder as a Path if it holds a config and weights; otherwise a ModelFolderError saying what lacks."""
    folder = Path(path)
    if not folder.exists():
        raise ModelFolderError(f"model folder '{folder}' does not exist (set model.path to a local Hugging Face "
                               f"folder; compute nodes cannot download from the hub)")
    if not folder.is_dir():
        raise ModelFolderError(f"model path '{folder}' is a file, not a Hugging Face model folder")
    if not (folder / "config.json").is_file():
        adapter = folder / "adapter_config.json"
        if adapter.is_file():
            base = _json_value(adapter, "base_model_name_or_path")
            raise ModelFolderError(f"model folder '{folder}' holds only a LoRA adapter (base model: {base}); "
                                   f"merge it into its base with `hpc-rlhf merge-lora {folder} MERGED_FOLDER`, or save "
                                   f"with model.lora.merge_on_save=true to get a full model folder")
        raise ModelFolderError(f"model folder '{folder}' has no config.json, so it is not a Hugging Face model "
                               f"folder")
    if not any((folder / name).is_file() for name in WEIGHT_FILES) and not any(folder.glob("*.safetensors")):
        raise ModelFolderError(f"model folder '{folder}' has a config.json but no weights "
                               f"(expected one of {', '.join(WEIGHT_FILES)})")
    check_safetensors_files(folder)
    return folder


def check_safetensors_files(folder: Path) -> None:
    """The safetensors files that transformers would load are whole: each one's size is what its header
    describes. An interrupted copy or a full disk leaves a truncated file, on which the safetensors library
    says only "invalid header length" without naming the file. Reads the headers only, not the weights."""
    if (folder / SAFETENSORS_FILE).is_file():  # transformers prefers it to an index
        shards = [SAFETENSORS_FILE]
    elif (folder / SAFETENSORS_INDEX).is_file():
        shards = safetensors_shards(folder)
    else:
        return  # PyTorch .bin weights: torch's own error on a damaged file says that it is corrupt
    for name in shards:
        problem = safetensors_file_problem(folder / name)
        if problem:
            raise ModelFolderError(f"model folder '{folder}': weight file {name} is truncated or corrupt "
                                   f"({problem}); copy or save the model again")


def safetensors_shards(folder: Path) -> list[str]:
    """The shard files named by the folder's model.safetensors.index.json, each checked to exist."""
    index = folder / SAFETENSORS_INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelFolderError(f"model folder '{folder}': {SAFETENSORS_INDEX} cannot be read ({exc}); the file "
                               f"is truncated or corrupt") from None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ModelFolderError(f"model folder '{folder}': {SAFETENSORS_INDEX} has no 'weight_map' of tensor "
                               f"names to shard files")
    shards = sorted(set(weight_map.values()))
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
        raise ModelFolderError(f"model folder '{folder}': {SAFETENSORS_INDEX} lists {len(missing)} shard "
                               f"file(s) that are missing: {', '.join(missing[:3])}")
    return shards


def safetensors_file_problem(path: Path) -> str | None:
    """None when the file's size matches its header, else what is wrong (the file format: an 8-byte
    little-endian header length, a JSON header giving each tensor's byte range, then the tensor bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        header_length = int.from_bytes(prefix, "little")
        if 8 + header_length > size:
            return f"{size} bytes, shorter than the {header_length}-byte header it announces"
        try:
            header = json.loads(handle.read(header_length))
            data_end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                           default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    expected = 8 + header_length + data_end
    if expected != size:
        return f"{size} bytes, where its header describes {expected}"
    return None


def process_reward_record(folder: str | Path):
    """The `process_reward` record of a model folder's config.json (what `hpc-rlhf prm` writes: the step marker and
    the reward tokens), or None for any other folder, or one whose config cannot be read (its loader names why)."""
    return _json_value(Path(folder) / "config.json", "process_reward")


def not_a_process_reward_model(folder: str | Path, key: str) -> None:
    """ModelFolderError for a sequence-level scorer given a process reward model, whose head would be started
    anew: such a model scores the steps of a solution, which only the RL recipes' reward roles read."""
    if process_reward_record(folder) is not None:
        raise ModelFolderError(f"{key}: '{folder}' is a process reward model (hpc-rlhf prm), which scores each step "
                               f"of a solution, not a whole sequence; here a reward model of whole sequences is "
                               f"needed (hpc-rlhf rm). The RL recipes' reward.models take a process reward model.")


def _json_value(path: Path, key: str):
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is not an object
        return None


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Whether two folders hold the same tokenizer files, byte for byte (then they load the same tokenizer; the
    usual case of a model trained from another): a check that needs no tokenizer library. False says nothing."""
    names = set(TOKENIZER_VOCABULARY_FILES) | set(TOKENIZER_JSON_FILES) | {"merges.txt"}
    a, b = Path(a), Path(b)
    names |= {p.name for folder in (a, b) for p in folder.glob("*.tiktoken")}
    found = False
    for name in sorted(names):
        ours, theirs = a / name, b / name
        if ours.is_file() != theirs.is_file():
            return False
        if ours.is_file():
            if ours.stat().st_size != theirs.stat().st_size or ours.read_bytes() != theirs.read_bytes():
                return False
            found = found or name in TOKENIZER_VOCABULARY_FILES or name.endswith(".tiktoken")
    return found


def tokenizer_folder_problem(folder: Path) -> str | None:
    """Why a tokenizer folder that failed to load cannot load, where that can be named: a JSON file that does not
    parse (a truncated copy), or no vocabulary file at all (not a tokenizer folder). None otherwise."""
    for name in TOKENIZER_JSON_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            return f"tokenizer folder '{folder}': {name} is not valid JSON ({exc}); the file is truncated or corrupt"
    if not any((folder / name).is_file() for name in TOKENIZER_VOCABULARY_FILES) and \
            not any(folder.glob("*.tiktoken")):
        return (f"tokenizer folder '{folder}' has no tokenizer files (none of "
                f"{', '.join(TOKENIZER_VOCABULARY_FILES)}): save the tokenizer into the folder, or set "
                f"model.tokenizer to the folder that has it")
    return None
