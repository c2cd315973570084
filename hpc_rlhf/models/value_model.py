"""Value models: the reward model and the critic, a causal-LM body with a scalar head.

Design: a value model is transformers' own `<Family>ForTokenClassification` with `num_labels=1`. Its `score`
head is a Linear(hidden, 1) applied at every position, which is exactly a critic (one value per token); the
reward of a sequence is the value at its last real token. Because the class is transformers' own, a saved
reward model or critic is a plain Hugging Face folder that `AutoModelForTokenClassification.from_pretrained`
loads back with its head, with no custom code and no extra head file.

Accepted folders:
  - `...ForTokenClassification` with one label: a value model saved by this project (or compatible);
  - `...ForSequenceClassification` with one label: a reward model trained elsewhere. Its head is the same
    Linear over every position; transformers pools it at the last non-pad token by pad id, which picks the
    wrong token when pad == eos, so the pooling is done here from the attention mask instead;
  - `...ForCausalLM`: an SFT checkpoint; the body is loaded and a new head is initialised (`init_value_head`).

Reward normalisation: `set_reward_normalization(model, mean, std)` stores the constants in the model config
(`reward_mean`, `reward_std`), so they are saved in config.json and a served reward model can apply them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                                                    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)

from hpc_rlhf.config import ModelSection
from hpc_rlhf.models.builders import (ModelFolderError, architecture_names, check_model_folder,
                                      check_nothing_missing, describe_architecture, load_pretrained,
                                      pretrained_kwargs, prepare_model, read_model_config)
from hpc_rlhf.models.lora import apply_lora, save_model, unwrap_model, value_head_name

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- loading
def value_model_kind(folder: Path, config) -> str:
    """'token' | 'sequence' | 'causal_lm': which kind of folder this is (see the module docstring)."""
    architectures = config.architectures or []
    kinds = (("token", MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
             ("sequence", MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
             ("causal_lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    for kind, mapping in kinds:
        if any(a in architecture_names(mapping) for a in architectures):
            return kind
    if not architectures and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal_lm"
    raise ModelFolderError(f"model folder '{folder}' holds a {describe_architecture(config)}, which is neither a "
                           f"causal LM nor a token/sequence classification model, so it cannot be a value model")


def head_class_for(folder: Path, config):
    """The transformers class that puts a per-token scalar head on this family's body."""
    if config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        return AutoModelForTokenClassification
    # A sequence-classification head is the same per-token Linear (pooled later), so it serves as well.
    if config.model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        return AutoModelForSequenceClassification
    raise ModelFolderError(f"model folder '{folder}': transformers has no token or sequence classification class "
                           f"for model_type '{config.model_type}', so no value head can be put on it")


def init_value_head(head: torch.nn.Linear) -> None:
    """Small random weights and zero bias: initial values are near 0, yet the body gets gradients at once
    (an all-zero weight would block them in the first step). std 1/sqrt(hidden+1) keeps the value's scale
    independent of the width."""
    with torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / math.sqrt(head.in_features + 1))
        if head.bias is not None:
            head.bias.zero_()


def build_value_model(model_cfg: ModelSection, for_training: bool = True,
                      device: torch.device | str | None = None, fold_normalization: bool = False):
    """A reward model or critic from `model_cfg.path` (see the module docstring for the accepted folders).

    From a causal-LM folder a new head is initialised when `model.init_value_head` is true (one warning says
    so); otherwise that folder is an error. With `for_training`, LoRA is applied when `model.lora.rank > 0`
    (the head stays trainable); without it the model is frozen in eval mode. `fold_normalization`: a critic
    started from a reward model predicts normalised rewards from its first step (`fold_reward_normalization`).
    """
    folder = check_model_folder(model_cfg.path)
    config = read_model_config(folder)
    check_reward_normalization_config(folder, config)
    kind = value_model_kind(folder, config)
    if kind == "causal_lm" and not model_cfg.init_value_head:
        raise ModelFolderError(f"model folder '{folder}' is a causal LM without a value head and "
                               f"model.init_value_head is false; point model.path at a reward/value model, or "
                               f"set model.init_value_head=true to start a new head")
    if kind in ("token", "sequence") and config.num_labels != 1:
        raise ModelFolderError(f"model folder '{folder}' holds a {describe_architecture(config)} with "
                               f"{config.num_labels} labels; a reward/value model has exactly one")
    if kind == "sequence":
        auto_class = AutoModelForSequenceClassification
    elif kind == "token":
        auto_class = AutoModelForTokenClassification
    else:
        auto_class = head_class_for(folder, config)
    config.num_labels = 1
    # Dropout in front of the head (0.1 by default in transformers) would make values noisy in training,
    # and the PPO ratio and value targets assume the same input gives the same value.
    if getattr(config, "classifier_dropout", None) is None:
        config.classifier_dropout = 0.0
    if config.pad_token_id is None:
        # Sequence-classification forward refuses batches without a pad id; pooling is done by mask anyway.
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    kwargs = pretrained_kwargs(model_cfg, device)
    model, missing = load_pretrained(auto_class, folder, "a value model", config=config, **kwargs)
    head = value_head_name(model)
    head_keys = {k for k in missing if k.startswith(head + ".")}
    if kind == "causal_lm":
        check_nothing_missing(folder, missing, allowed=head_keys)
        init_value_head(getattr(model, head))
        logger.warning("value model from the causal LM in '%s': its %s head (%s) is newly initialised",
                       folder, head, ", ".join(sorted(head_keys)))
    else:
        check_nothing_missing(folder, missing)
    if fold_normalization:
        fold_reward_normalization(model)
    if device is not None and "device_map" not in kwargs:
        model.to(device)
    prepare_model(model, model_cfg, for_training)
    if for_training and model_cfg.lora.rank > 0:
        model = apply_lora(model, model_cfg.lora, task="value", gradient_checkpointing=model_cfg.gradient_checkpointing)
    return model


# --------------------------------------------------------------------------------------------- pure maths
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so a left-padded row gets the same positions as the same row
    right-padded (transformers would otherwise count the pads). Pads get position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B,) index of the last 1 of each row; left, right or no padding alike."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, time), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    empty = ~mask.any(-1)
    if empty.any():
        raise ValueError(f"attention_mask rows {empty.nonzero().flatten().tolist()} have no real token")
    width = mask.shape[-1]
    return width - 1 - mask.flip(-1).long().argmax(-1)


def gather_last(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values -> (B,) value at each row's last real token."""
    index = last_token_index(attention_mask).to(values.device)
    return values.gather(-1, index.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------- forward
def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None = None, head: torch.nn.Module | None = None,
                 **forward_kwargs) -> torch.Tensor:
    """(B, T) float32 value of every token (the critic); 0 at padding.

    Packed rows (hpc_rlhf.rl.packed): no `attention_mask`, the restarting `position_ids` and any further keyword
    arguments of a packed forward (`forward_kwargs`); every position's value is returned, padding blocks included.
    A 4D `attention_mask` (shared-prompt pairs, hpc_rlhf.data.examples.shared_prompt_pair_collate) goes to the model
    as it is, with the `position_ids` given; every position's value is returned too.

    `model` may be a value model, its peft wrapper or its DeepSpeed engine; the full forward of the outermost
    wrapper runs (engines and adapters need that), and the head's per-token output is caught on its way out,
    before any pooling a sequence-classification model would do. `head`: the value head, where `model` is a
    wrapper this function does not know (a TrainEngine, whose forward must run when the values are trained on:
    under ZeRO-3 a forward of the bare module left DeepSpeed's gradient handling wrong).
    """
    head = head if head is not None else getattr(unwrap_model(model), value_head_name(model))
    caught = []
    handle = head.register_forward_hook(lambda module, args, output: caught.append(output))
    try:
        if position_ids is None:
            if attention_mask is None or attention_mask.dim() == 4:
                raise ValueError("token_values: packed rows (no attention_mask) and 4D attention masks need their "
                                 "position_ids")
            position_ids = position_ids_from_mask(attention_mask)
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
              **forward_kwargs)
    finally:
        handle.remove()
    if len(caught) != 1:
        raise RuntimeError(f"the value head ran {len(caught)} times in one forward pass, expected once")
    values = caught[0].squeeze(-1).float()
    if attention_mask is None or attention_mask.dim() == 4:
        return values
    # Pad positions can hold garbage (even NaN from fully masked attention rows); 0 keeps masked sums finite.
    return torch.where(attention_mask.bool().to(values.device), values, torch.zeros_like(values))


def check_reward_normalization_config(folder: Path, config) -> None:
    """reward_mean and reward_std in a folder's config.json, when there, are usable: a hand-edited or damaged
    value (null, text, a std of 0) would otherwise end a run in a TypeError or turn every reward into inf."""
    for key in ("reward_mean", "reward_std"):
        if not hasattr(config, key):
            continue
        value = getattr(config, key)
        usable = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
            (key == "reward_mean" or value > 0)
        if not usable:
            need = "a finite number" if key == "reward_mean" else "a positive finite number"
            raise ModelFolderError(f"model folder '{folder}': config.json has {key}={value!r}, which must be {need} "
                                   f"(reward normalisation); train the reward model again, or delete reward_mean "
                                   f"and reward_std to score without normalisation")


def reward_normalization(model) -> tuple[float, float]:
    """(mean, std) stored in the model config; (0, 1) when none was set."""
    config = unwrap_model(model).config
    return float(getattr(config, "reward_mean", 0.0)), float(getattr(config, "reward_std", 1.0))


def set_reward_normalization(model, mean: float, std: float) -> None:
    """Store reward normalisation constants in the config (saved with the model in config.json)."""
    if not (math.isfinite(mean) and math.isfinite(std)) or std <= 0:
        raise ValueError(f"reward normalisation needs a finite mean and a positive std, got mean={mean}, std={std}")
    config = unwrap_model(model).config
    config.reward_mean = float(mean)
    config.reward_std = float(std)


def fold_reward_normalization(model) -> None:
    """Fold the stored reward normalisation into the value head: weight / std, (bias - mean) / std, and the
    config's constants reset to (0, 1), so the raw head outputs what `sequence_scores(normalize=True)` gave.

    Why: PPO's critic starts from the reward model (InstructGPT's choice) but learns returns built from the
    normalised scores; an unfolded head starts in the reward model's raw units (measured on the tiny task: raw
    scores around 10-20, a first value loss of 114 against returns of about 1), and until it has unlearned them
    its GAE advantages are mostly noise (held-out exact match 0.62 -> 0.77 -> 0.62 over 40 steps). A head without
    a bias (sequence-classification heads) gets one; such a critic's saved folder then holds a `score.bias` that
    transformers' sequence-classification class does not load back (reported as an unused tensor), so reload it
    with its training checkpoint, which keeps the bias, rather than from that folder."""
    mean, std = reward_normalization(model)
    if (mean, std) == (0.0, 1.0):
        return
    base = unwrap_model(model)
    name = value_head_name(base)
    head = getattr(base, name)
    with torch.no_grad():
        if head.bias is None:
            biased = torch.nn.Linear(head.in_features, head.out_features, bias=True,
                                     device=head.weight.device, dtype=head.weight.dtype)
            biased.weight.copy_(head.weight)
            biased.bias.zero_()
            setattr(base, name, biased)
            head = biased
        head.weight.div_(std)
        head.bias.sub_(mean).div_(std)
    base.config.reward_mean = 0.0
    base.config.reward_std = 1.0


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    normalize: bool = False) -> torch.Tensor:
    """(B,) float32 reward of each sequence: the value at its last real token (left or right padding).

    With `normalize`, (score - reward_mean) / reward_std from the model config.
    """
    return normalized_scores(model, gather_last(token_values(model, input_ids, attention_mask), attention_mask),
                             normalize)


def normalized_scores(model, scores: torch.Tensor, normalize: bool) -> torch.Tensor:
    """With `normalize`, (score - reward_mean) / reward_std from the model config; else the scores as they are."""
    if normalize:
        mean, std = reward_normalization(model)
        scores = (scores - mean) / std
    return scores


def save_value_model(model, output_dir: str | Path, tokenizer=None, merge_lora: bool = True) -> Path:
    """Save as a Hugging Face folder that `build_value_model` and `AutoModelForTokenClassification` (or, for
    a model loaded from a sequence-classification folder, `AutoModelForSequenceClassification`) load back
    with the head and any reward normalisation constants. LoRA: merged, or an adapter folder."""
    return save_model(model, output_dir, tokenizer=tokenizer, merge=merge_lora)
