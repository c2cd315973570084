"""`hpc-rlhf merge-lora ADAPTER OUTPUT`: a LoRA adapter folder merged into its base, written as a plain model folder.

A LoRA run with `model.lora.merge_on_save=false` (`actor.lora.merge_on_save=false` in RL) saves the adapter alone:
small, and what vLLM serves beside its base, but not a folder that `from_pretrained` or this project's `model.path`
loads by itself. This writes the merged model: the base (adapter_config.json's `base_model_name_or_path`, or
`--base`) loaded in float32, the adapter added by peft and folded into the weights (`merge_and_unload`), saved in
the base's own dtype (or `--dtype`) with the adapter folder's tokenizer (else the base's; none if neither has one).
A reward model's or critic's adapter (peft's TOKEN_CLS / SEQ_CLS task) brings its trained head with it and merges
into a value model, with the reward normalisation its run wrote beside the adapter (reward_normalization.json).

The base is read in float32 on the CPU, so the machine needs about 4 bytes of memory per parameter; the merge
itself adds nothing. `--low-memory` reads it in the dtype it is written in instead (2 bytes per parameter for a
bfloat16 model: 140 GB for a 70B one instead of 280): each merged weight is then rounded twice (the adapter's
product to that dtype, then the sum) instead of once, so it may differ from the float32 merge by that dtype's
rounding (identical on the tiny model; tested within two steps of the weight's and the product's sizes). The
output folder must not exist yet: the merge is written beside it and renamed into place once whole, so a failed
merge leaves nothing behind and an existing folder is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open

from hpc_rlhf.config import ModelSection
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.models.folders import ModelFolderError, check_model_folder, tokenizer_folder_problem
from hpc_rlhf.models.lora import ADAPTER_WEIGHTS_FILE, REWARD_NORMALIZATION_FILE
from hpc_rlhf.models.saving import save_pretrained_on_this_rank
from hpc_rlhf.models.value_model import build_value_model, set_reward_normalization

CAUSAL_TASKS = {"CAUSAL_LM"}
VALUE_TASKS = {"TOKEN_CLS", "SEQ_CLS"}
DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_CONFIG_MAX_BYTES = 1 << 20  # a peft adapter_config.json is a few hundred bytes


def read_adapter_config(folder: Path) -> dict:
    """adapter_config.json of a LoRA adapter folder, checked for what the merge needs; ModelFolderError naming the
    folder and the key otherwise."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        has_model = (folder / "config.json").is_file()
        raise ModelFolderError(f"'{folder}' has no adapter_config.json, so it is not a LoRA adapter folder"
                               + (" (it holds a whole model already: nothing to merge)" if has_model else ""))
    if path.stat().st_size > ADAPTER_CONFIG_MAX_BYTES:
        raise ModelFolderError(f"'{path}' is {path.stat().st_size} bytes, too large for a peft adapter config")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"'{path}' is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelFolderError(f"'{path}' holds {type(config).__name__}, not an object")
    if config.get("peft_type") != "LORA":
        raise ModelFolderError(f"'{path}': peft_type is {config.get('peft_type')!r}; only LoRA adapters are merged")
    task = config.get("task_type")
    if task not in CAUSAL_TASKS | VALUE_TASKS:
        raise ModelFolderError(f"'{path}': task_type {task!r} is none of {sorted(CAUSAL_TASKS | VALUE_TASKS)}")
    return config


def base_folder(adapter: Path, config: dict, given: str | None) -> Path:
    """The base model folder: `--base`, or the adapter's `base_model_name_or_path` as written (relative paths
    from the working directory, as the run that saved it read them)."""
    if given:
        return Path(given)
    named = config.get("base_model_name_or_path")
    if not named:
        raise ModelFolderError(f"'{adapter / 'adapter_config.json'}' names no base_model_name_or_path; "
                               f"give the base with --base")
    if not Path(named).exists():
        raise ModelFolderError(f"the base model '{named}' named by '{adapter / 'adapter_config.json'}' does not "
                               f"exist here (a path relative to the run's working directory, or a hub name); "
                               f"give the base with --base")
    return Path(named)


def saved_dtype(base: Path, asked: str | None) -> str:
    """The dtype the merged model is written in: `asked`, else the base's config dtype (float32 if it has none)."""
    if asked:
        return asked
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


def apply_reward_normalization(adapter: Path, model) -> None:
    """The reward model's normalisation constants that its run wrote beside the adapter (the merged config.json
    carries them again); nothing when the adapter has none."""
    path = adapter / REWARD_NORMALIZATION_FILE
    if not path.is_file():
        return
    try:
        if path.stat().st_size > 4096:
            raise ValueError(f"{path.stat().st_size} bytes, where two numbers take a few dozen")
        constants = json.loads(path.read_text(encoding="utf-8"))
        set_reward_normalization(model, constants["reward_mean"], constants["reward_std"])
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise ModelFolderError(f"'{path}' does not hold a usable reward_mean and reward_std "
                               f"({type(exc).__name__}: {exc})") from None


def check_every_tensor_loaded(adapted, adapter: Path, misfit: str) -> None:
    """peft loads an adapter into a base of another depth with a warning only (the layers the file lacks keep
    their identity adapters, the file's extra layers are dropped): here the file's tensors and the adapted model's
    must be the same names."""
    with safe_open(str(adapter / ADAPTER_WEIGHTS_FILE), "pt") as weights:
        saved = set(weights.keys())
    expected = set(get_peft_model_state_dict(adapted))
    if saved != expected:
        missing, extra = sorted(expected - saved), sorted(saved - expected)
        raise ModelFolderError(f"{misfit}: the base has {len(missing)} adapted tensors the adapter lacks "
                               f"{missing[:2]} and the adapter {len(extra)} the base has no place for {extra[:2]}")


def merge(adapter: str | Path, output: str | Path, base: str | None = None, dtype: str | None = None,
          low_memory: bool = False) -> Path:
    """Merge the LoRA adapter folder `adapter` into its base and write the model to `output` (which must not
    exist). Returns `output`. `low_memory`: the base is held in its own stored dtype, not float32 (see above)."""
    adapter, output = Path(adapter), Path(output)
    if output.exists():
        raise FileExistsError(f"output folder '{output}' exists; the merge never overwrites one (remove it or "
                              f"name another)")
    config = read_adapter_config(adapter)
    if not (adapter / ADAPTER_WEIGHTS_FILE).is_file():
        raise ModelFolderError(f"'{adapter}' has no {ADAPTER_WEIGHTS_FILE} (adapters in pickled .bin files are not "
                               f"read)")
    base_path = check_model_folder(base_folder(adapter, config, base))
    target = saved_dtype(base_path, dtype)
    held = saved_dtype(base_path, None) if low_memory else "float32"
    section = ModelSection(path=str(base_path), dtype=held, init_value_head=True)
    if config["task_type"] in CAUSAL_TASKS:
        model = build_causal_lm(section, for_training=False)
    else:
        model = build_value_model(section, for_training=False)  # the adapter brings the trained head
    misfit = f"the adapter in '{adapter}' does not fit the base '{base_path}'"
    try:
        with warnings.catch_warnings():  # peft warns of missing keys; check_every_tensor_loaded refuses them
            warnings.filterwarnings("ignore", message="Found missing adapter keys")
            adapted = PeftModel.from_pretrained(model, str(adapter))
    except (RuntimeError, ValueError, KeyError) as exc:  # shapes or module names that are not this base's
        raise ModelFolderError(f"{misfit}: {exc}") from None
    check_every_tensor_loaded(adapted, adapter, misfit)
    merged = adapted.merge_and_unload()
    if config["task_type"] in VALUE_TASKS:
        apply_reward_normalization(adapter, merged)
    merged.to(getattr(torch, target))
    tokenizer_source = next((f for f in (adapter, base_path) if tokenizer_folder_problem(f) is None), None)
    partial = output.with_name(f".{output.name}.merging-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_pretrained_on_this_rank(merged, partial)
        if tokenizer_source is not None:
            load_tokenizer(tokenizer_source).save_pretrained(str(partial))
        partial.rename(output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return output


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hpc-rlhf merge-lora", description=__doc__.splitlines()[0])
    parser.add_argument("adapter", help="a LoRA adapter folder (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("output", help="the merged model's folder (must not exist)")
    parser.add_argument("--base", default=None,
                        help="the base model folder (default: base_model_name_or_path in adapter_config.json)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the written weights (default: the base's)")
    parser.add_argument("--low-memory", action="store_true",
                        help="hold the base in its stored dtype instead of float32 (half the memory for a bfloat16 "
                             "base; each weight may differ from the float32 merge by that dtype's rounding)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = merge(args.adapter, args.output, base=args.base, dtype=args.dtype, low_memory=args.low_memory)
    except (ModelFolderError, FileExistsError) as exc:
        print(f"hpc-rlhf merge-lora: {exc}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into its base: {out}")
    return 0
