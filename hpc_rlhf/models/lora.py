"""LoRA and QLoRA adapters through peft, and saving adapted models as Hugging Face folders.

`apply_lora` freezes the base model and adds adapters to `model.lora.target_modules`; a value model's scalar
head stays fully trainable (it is new, so it must be learnt, and it is small). QLoRA loads the frozen base in
4-bit with bitsandbytes, which needs a CUDA GPU: `quantization_config` says so plainly anywhere else.

Saving (`save_model`): with `merge=True` the adapters are folded into the weights and the folder is a plain
model that transformers and vLLM load without peft; otherwise it is a peft adapter folder. Merging computes
W + B A * scale into a new state dict and leaves the model as it was, so training can go on after a save.

peft is imported inside the functions that use it: importing it takes about two seconds, and only runs with
adapters (model.lora.rank > 0) need it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import BitsAndBytesConfig

from hpc_rlhf.config import ConfigError, LoraSection
from hpc_rlhf.models.saving import save_pretrained_on_this_rank

logger = logging.getLogger(__name__)

TASKS = ("causal_lm", "value")


# -------------------------------------------------------------------------------------------------- QLoRA
def check_qlora_supported() -> None:
    """QLoRA runs only where bitsandbytes can: on a CUDA GPU with the package installed."""
    if not torch.cuda.is_available():
        raise ConfigError("model.lora.load_in_4bit=true (QLoRA) needs a CUDA GPU: bitsandbytes 4-bit weights do "
                          "not run on the CPU; set model.lora.load_in_4bit=false here")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.lora.load_in_4bit=true (QLoRA) needs the bitsandbytes package, which is not "
                          "installed: install the `gpu` extra (pip install 'hpc_rlhf[gpu]')")


def quantization_config(lora_cfg: LoraSection):
    """The 4-bit loading config for QLoRA (NF4, double quantization, bf16 compute), or None without QLoRA."""
    if not lora_cfg.load_in_4bit:
        return None
    if lora_cfg.rank <= 0:
        raise ConfigError("model.lora.load_in_4bit=true needs model.lora.rank > 0: 4-bit weights cannot be "
                          "trained directly, only adapters on top of them")
    check_qlora_supported()
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------ adapters
def is_peft_model(model) -> bool:
    # A peft model exists only once peft has been imported: asking must not import it (1.5 CPU-seconds, paid by
    # every rank that syncs or saves a model without adapters).
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel  # slow to import: see the module docstring

    return isinstance(model, PeftModel)


def unwrap_model(model):
    """The transformers model inside a DeepSpeed engine and/or a peft wrapper (adapters stay injected)."""
    if hasattr(model, "module") and type(model).__name__ == "DeepSpeedEngine":
        model = model.module
    if is_peft_model(model):
        model = model.get_base_model()
    return model


def value_head_name(model) -> str:
    if not hasattr(unwrap_model(model), "score"):
        raise ValueError(f"{type(unwrap_model(model)).__name__} has no `score` head: not a value model")
    return "score"


def lora_config(lora_cfg: LoraSection, task: str, model=None):
    from peft import LoraConfig, TaskType  # slow to import: see the module docstring

    if task not in TASKS:
        raise ValueError(f"LoRA task must be one of {TASKS}, got {task!r}")
    if lora_cfg.rank <= 0:
        raise ConfigError("LoRA needs model.lora.rank > 0 (rank 0 means full fine-tuning)")
    if task == "causal_lm":
        task_type, modules_to_save = TaskType.CAUSAL_LM, None
    else:
        # peft's classification wrappers keep the head trainable and save it with the adapter.
        name = type(unwrap_model(model)).__name__ if model is not None else ""
        task_type = TaskType.SEQ_CLS if name.endswith("ForSequenceClassification") else TaskType.TOKEN_CLS
        modules_to_save = [value_head_name(model)] if model is not None else ["score"]
    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=list(lora_cfg.target_modules), task_type=task_type,
                      modules_to_save=modules_to_save, bias="none")


def check_target_modules(model, lora_cfg: LoraSection, where: str = "model.lora") -> None:
    """Every name in `target_modules` must name a layer of `model` (peft's rule for a list: the module's name or
    its last dotted part): peft itself only refuses a list of which no name matches, and would train fewer
    layers than asked without a word."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in lora_cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    which = "" if len(missing) == len(lora_cfg.target_modules) else f": {missing}"
    raise ConfigError(f"{where}.target_modules={list(lora_cfg.target_modules)}{which} matches no layer of "
                      f"{type(model).__name__}; its linear layers are: {', '.join(linear)}")


def apply_lora(model, lora_cfg: LoraSection, task: str = "causal_lm", gradient_checkpointing: bool = False,
               where: str = "model.lora"):
    """Wrap `model` in peft LoRA adapters: only adapters (and a value model's head) remain trainable. `where` is
    the config key of `lora_cfg`, for the error on target modules the model lacks."""
    from peft import get_peft_model, prepare_model_for_kbit_training  # slow to import: see the module docstring

    config = lora_config(lora_cfg, task, model)
    check_target_modules(model, lora_cfg, where)
    if getattr(model, "is_loaded_in_4bit", False):
        # Casts norms to fp32 and freezes the quantized base, as QLoRA training needs.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`; the warning is not ours to fix.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, config)
    except ValueError as exc:
        if "target" in str(exc).lower():  # a module peft cannot adapt (checked above: not a missing name)
            raise ConfigError(f"{where}.target_modules={list(lora_cfg.target_modules)}: {exc}") from None
        raise
    return peft_model


# ------------------------------------------------------------------------------------------------- merging
def _dequantized_weight(module) -> torch.Tensor | None:
    """Full-precision weight of a bitsandbytes 4-bit layer (QLoRA), or None for an ordinary layer."""
    weight = getattr(module, "weight", None)
    if weight is None or not hasattr(weight, "quant_state"):
        return None
    from peft.utils.integrations import dequantize_module_weight  # slow to import: see the module docstring

    return dequantize_module_weight(module).detach()


def _plain_name(name: str) -> str:
    """A parameter or module name inside a peft model -> its name in the plain transformers model."""
    name = re.sub(r"\.base_layer(?=\.|$)", "", name)
    return re.sub(r"\.modules_to_save\.[^.]+(?=\.|$)", "", name)


def _no_gather(params):
    return contextlib.nullcontext()


def _is_adapter_unit(module) -> bool:
    from peft.tuners.lora import LoraLayer  # slow to import: see the module docstring

    return isinstance(module, LoraLayer)


def merged_tensors(model, gather: Callable = _no_gather, emit: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the plain transformers model with every active adapter folded in, one module at a time;
    `model` is not changed.

    Names are those of the model without peft (`model.layers.0.self_attn.q_proj.weight`), in state-dict order.
    A unit is a module's own parameters and persistent buffers, or a whole LoRA layer (base layer and adapters,
    whose merged weight needs all of them). `gather(params)` is a context manager that makes `params` whole
    while the unit's tensors are yielded (ZeRO-3); a yielded tensor is valid only until the next one is
    requested. With `emit=False` the units are gathered and released in the same order but nothing is computed
    or yielded (the other ranks of a ZeRO-3 group, which must take part in every gather).
    """
    peft = is_peft_model(model)
    base = unwrap_model(model)
    done: list[str] = []  # subtrees already handled (a LoRA layer) or left out (a trained head's frozen copy)
    for name, module in base.named_modules():
        if any(name.startswith(prefix) for prefix in done):
            continue
        if peft and (name.endswith(".original_module") or ".original_module." in name):
            done.append(name + ".")
            continue
        if peft and _is_adapter_unit(module):
            done.append(name + ".")
            params = list(module.parameters())
            with gather(params):
                if emit:
                    yield from _merged_adapter_layer(name, module)
            continue
        own = list(module.named_parameters(recurse=False))
        with gather([p for _, p in own]):
            if not emit:
                continue
            quantized = _dequantized_weight(module) if peft else None
            for key, param in own:
                if quantized is not None and key == "weight":
                    param = quantized
                yield _plain_name(_join(name, key)), param
            for key, buffer in _persistent_buffers(module):
                yield _plain_name(_join(name, key)), buffer


def _merged_adapter_layer(name: str, module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA layer's base tensors under their plain names, the weight with W + B A * scale folded in."""
    base_layer = module.get_base_layer()
    quantized = _dequantized_weight(base_layer)
    for key, param in base_layer.named_parameters(recurse=False):
        tensor = param.detach()
        if key == "weight":
            weight = quantized if quantized is not None else tensor
            if not module.merged:
                delta = sum(module.get_delta_weight(a).float() for a in module.active_adapters if a in module.lora_A)
                # Sum in fp32: adding a small delta to bf16 weights in bf16 would round most of it away.
                weight = (weight.float() + delta.to(weight.device)).to(weight.dtype)
            tensor = weight
        yield _plain_name(f"{name}.{key}"), tensor
    for key, buffer in _persistent_buffers(base_layer):
        yield _plain_name(f"{name}.{key}"), buffer


def _persistent_buffers(module) -> Iterator[tuple[str, torch.Tensor]]:
    for key, buffer in module.named_buffers(recurse=False):
        if buffer is not None and key not in module._non_persistent_buffers_set:
            yield key, buffer


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Every tensor of `merged_tensors(model)` in one dict (detached; under ZeRO-3 the caller gathers first).

    Names are those of the model without peft, so the result can be saved as a Hugging Face folder.
    """
    return {name: tensor.detach() for name, tensor in merged_tensors(model)}


# ---------------------------------------------------------------------------------------------- the adapter
# LoRA RL moves and saves the adapter alone (rl/sync.py): its tensors travel under the names of PEFT's adapter file
# (adapter_model.safetensors), so that peft, vLLM and a receiving copy of the model all read them as they are.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
REWARD_NORMALIZATION_FILE = "reward_normalization.json"  # a reward model's constants beside its adapter


def _peft_model(model):
    """The peft model inside a DeepSpeed engine (or `model` itself)."""
    if hasattr(model, "module") and type(model).__name__ == "DeepSpeedEngine":
        model = model.module
    if not is_peft_model(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapter (model.lora.rank is 0)")
    return model


def _adapter_layers(model) -> Iterator[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """Per LoRA layer of a peft model: its name and its adapter parameters under their names in PEFT's file
    (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`; the adapter's own name is not part of them)."""
    peft_model = _peft_model(model)
    for name, module in peft_model.named_modules():
        if not _is_adapter_unit(module):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if len(adapters) != 1:
            raise ValueError(f"{name}: {len(adapters)} active LoRA adapters; the adapter alone moves one")
        adapter = adapters[0]
        if module.lora_embedding_A or not isinstance(module.lora_A[adapter], torch.nn.Linear):
            raise ConfigError(f"{name}: the adapter alone is synced and saved for LoRA on linear layers; "
                              f"{type(module.get_base_layer()).__name__} layers are not supported there")
        yield name, [(f"{name}.lora_A.weight", module.lora_A[adapter].weight),
                     (f"{name}.lora_B.weight", module.lora_B[adapter].weight)]


def adapter_tensors(model, gather: Callable = _no_gather, emit: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the LoRA adapter alone, named as in PEFT's adapter file, one LoRA layer at a time; the
    base weights are not read. `gather` and `emit` as in `merged_tensors` (ZeRO-3: a layer's two matrices gathered
    while they are yielded; a yielded tensor is valid until the next one is requested)."""
    for _, params in _adapter_layers(model):
        with gather([p for _, p in params]):
            if emit:
                for name, param in params:
                    yield name, param.detach()


def adapter_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters of a (not partitioned) peft model by their names in PEFT's adapter file: where a
    receiving copy loads what `adapter_tensors` sent."""
    return {name: param for _, params in _adapter_layers(model) for name, param in params}


@contextlib.contextmanager
def adapter_disabled(model):
    """Inside the block the model computes as its base model, every adapter off (peft's `disable_adapter`): the
    reference of LoRA RL, with no second copy of the weights."""
    with _peft_model(model).disable_adapter():
        yield


def write_adapter_folder(folder: str | Path, tensors: dict[str, torch.Tensor], lora_cfg: LoraSection,
                         base_model: str) -> Path:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) holding `tensors` (named as
    `adapter_tensors` names them) for the model in `base_model`: what peft's `PeftModel.from_pretrained` and
    vLLM's `LoRARequest` load."""
    from safetensors.torch import save_file  # only the adapter folders of LoRA runs need it

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = lora_config(lora_cfg, "causal_lm")
    config.base_model_name_or_path = str(base_model)
    config.save_pretrained(str(folder))
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
              str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def merge_and_unload_for_save(model):
    """The plain transformers model with adapters merged in place (peft's merge_and_unload).

    The adapters are gone afterwards: use it once training is over (e.g. to hand the model to an evaluator).
    To save while training goes on, `save_model(..., merge=True)` merges into a copy of the weights instead.
    """
    if not is_peft_model(model):
        return unwrap_model(model)
    if getattr(unwrap_model(model), "is_loaded_in_4bit", False):
        raise ValueError("a QLoRA model cannot be merged in place (its base weights are 4-bit); "
                         "save it with save_model(..., merge=True), which writes dequantized merged weights")
    return model.merge_and_unload()


def save_model(model, output_dir: str | Path, tokenizer=None, merge: bool = True) -> Path:
    """Write `model` as a Hugging Face folder (safetensors), plus the tokenizer when given.

    A LoRA model is saved merged (a plain folder, no peft needed to load it) or, with `merge=False`, as a peft
    adapter folder. Call on one rank only; under ZeRO-3 gather the parameters first.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if is_peft_model(model) and not merge:
        save_pretrained_on_this_rank(model, output_dir)
        _write_reward_normalization(unwrap_model(model).config, output_dir)
    else:
        base = unwrap_model(model)
        state = merged_state_dict(model) if is_peft_model(model) else None
        save_pretrained_on_this_rank(base, output_dir, state_dict=state)
        if getattr(base, "is_loaded_in_4bit", False):
            _drop_quantization_config(output_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(output_dir))
    return output_dir


def _write_reward_normalization(config, output_dir: Path) -> None:
    """A reward model's normalisation constants live in its config.json, which an adapter folder does not have:
    they go beside the adapter (REWARD_NORMALIZATION_FILE), where `hpc-rlhf merge-lora` puts them back."""
    if hasattr(config, "reward_mean") or hasattr(config, "reward_std"):
        constants = {key: getattr(config, key) for key in ("reward_mean", "reward_std") if hasattr(config, key)}
        (output_dir / REWARD_NORMALIZATION_FILE).write_text(json.dumps(constants, indent=2) + "\n")


def _drop_quantization_config(output_dir: Path) -> None:
    """The merged QLoRA weights are dequantized, so the saved config must not claim 4-bit weights."""
    path = output_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
