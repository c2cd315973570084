"""Tokenizers and causal language models (actor, reference) from local Hugging Face folders.

Compute nodes have no internet, so every model is a local folder (`model.path`). Whatever is wrong with the
folder - missing, no config.json, no weights, an architecture of the wrong kind, weights that do not fit the
config - is reported as one `ModelFolderError` that names the folder and the problem, before an hour of
queueing is spent on a job that cannot start.

GPU-only pieces (flash-attn, bitsandbytes) are never imported here; their presence is checked with
`importlib.util.find_spec` so that the CPU path works without them.

Layers of hpc_rlhf/models, each importing only those before it: folders -> saving -> lora -> builders ->
value_model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hpc_rlhf.config import ConfigError, ModelSection
from hpc_rlhf.models.folders import ModelFolderError, check_model_folder, tokenizer_folder_problem
from hpc_rlhf.models.lora import apply_lora, quantization_config

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(folder: str | Path):
    """The folder's transformers config, with unreadable or unknown configs reported against the folder."""
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFolderError(f"model folder '{folder}': config.json cannot be read: {exc}") from None


def architecture_names(auto_mapping_names: dict) -> set[str]:
    """Class names of a transformers auto mapping (its values are names or tuples of names)."""
    names = set()
    for value in auto_mapping_names.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def describe_architecture(config) -> str:
    return ", ".join(config.architectures or []) or f"model_type '{config.model_type}'"


def check_causal_lm_config(folder: Path, config) -> None:
    causal = architecture_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    architectures = config.architectures or []
    fits = any(a in causal for a in architectures) if architectures else \
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not fits or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        hint = ""
        if any(a.endswith(("ForTokenClassification", "ForSequenceClassification")) for a in architectures):
            hint = " (it is a reward/value model: load it with build_value_model)"
        raise ModelFolderError(f"model folder '{folder}' holds a {describe_architecture(config)}, which is not a "
                               f"causal language model{hint}")


# ------------------------------------------------------------------------------------------------- settings
def resolve_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """`auto` is bfloat16 where the model will run on CUDA and float32 on the CPU (CPU bf16 matmuls are slow)."""
    if name == "auto":
        on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        return torch.bfloat16 if on_cuda else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"key 'model.dtype' must be one of {['auto', *DTYPES]}, got {name!r}")
    return DTYPES[name]


def check_attn_implementation(name: str) -> str:
    """Fail early, with the fix, when flash_attention_2 cannot run here."""
    if name not in ("sdpa", "eager", "flash_attention_2"):
        raise ConfigError(f"key 'model.attn_implementation' must be sdpa, eager or flash_attention_2, got {name!r}")
    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is "
                              "not installed: install the `flash-attn` extra (pip install --no-build-isolation "
                              "'hpc_rlhf[flash-attn]') on a CUDA machine, or build the image with --build-arg "
                              "FLASH_ATTN=1, or use model.attn_implementation=sdpa")
        if not torch.cuda.is_available():
            raise ConfigError("model.attn_implementation=flash_attention_2 needs a CUDA GPU; "
                              "use model.attn_implementation=sdpa on the CPU")
    return name


def pretrained_kwargs(model_cfg: ModelSection, device: torch.device | str | None = None) -> dict:
    """Keyword arguments of `from_pretrained` shared by every model builder."""
    kwargs = {"dtype": resolve_dtype(model_cfg.dtype, device),
              "attn_implementation": check_attn_implementation(model_cfg.attn_implementation)}
    quant = quantization_config(model_cfg.lora)
    if quant is not None:
        kwargs["quantization_config"] = quant
        # bitsandbytes quantizes while loading, so the weights must land on their GPU directly.
        target = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        kwargs["device_map"] = {"": target}
    return kwargs


@contextlib.contextmanager
def quiet_transformers_loading():
    """Silence transformers' load report while we inspect the loading info and report problems ourselves.

    The report is a table of every missing/unexpected tensor; we turn it into one message (or an error), and
    the tensor-parallel plan check warns about every head that has no TP rule, which means nothing here.
    """
    names = ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def load_pretrained(auto_class, folder: Path, what: str, **kwargs):
    """`auto_class.from_pretrained(folder)` -> (model, missing tensor names); other load problems raise.

    Tensors of the wrong shape mean the weights belong to another config: an error, never a silent re-init.
    """
    try:
        with quiet_transformers_loading():
            model, info = auto_class.from_pretrained(str(folder), output_loading_info=True,
                                                     ignore_mismatched_sizes=True, **kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise ModelFolderError(f"model folder '{folder}' cannot be loaded as {what}: {exc}") from None
    if info["mismatched_keys"]:
        examples = sorted(info["mismatched_keys"])[:3]
        shown = "; ".join(f"{name} is {tuple(got)} in the file, {tuple(want)} in the config"
                          for name, got, want in examples)
        raise ModelFolderError(f"model folder '{folder}': {len(info['mismatched_keys'])} weight tensors do not "
                               f"match config.json ({shown})")
    if info["unexpected_keys"]:
        logger.info("%s: %d tensors in the weights are not used by %s", folder, len(info["unexpected_keys"]),
                    type(model).__name__)
    return model, set(info["missing_keys"])


def check_nothing_missing(folder: Path, missing: set[str], allowed: set[str] = frozenset()) -> None:
    lacking = sorted(missing - set(allowed))
    if lacking:
        raise ModelFolderError(f"model folder '{folder}': the weights lack {len(lacking)} tensors of the model "
                               f"(e.g. {', '.join(lacking[:3])}); the folder is incomplete or its config.json "
                               f"describes another model")


def prepare_model(model, model_cfg: ModelSection, for_training: bool):
    """Training: gradient checkpointing and no KV cache. Inference (reference, reward): eval mode, no grads."""
    if for_training:
        model.train()
        model.config.use_cache = False  # a cache is useless in training and wrong with checkpointing
        if model_cfg.gradient_checkpointing:
            # Non-reentrant checkpointing works with frozen embeddings (LoRA) without input-grad tricks.
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.eval()
        model.requires_grad_(False)
    return model


# ------------------------------------------------------------------------------------------------ public API
def load_tokenizer(path: str | Path, pad_to_eos: bool = False):
    """The tokenizer of a local folder. Batches need a pad token: without one this is an error naming the
    folder, unless `pad_to_eos` asks to pad with the end-of-sequence token (a warning says so)."""
    folder = Path(path)
    if folder.is_file():
        raise ModelFolderError(f"tokenizer path '{folder}' is a file, not a folder (set model.tokenizer or "
                               f"model.path to the folder that holds the tokenizer files)")
    if not folder.is_dir():
        raise ModelFolderError(f"tokenizer folder '{folder}' does not exist (set model.tokenizer or model.path)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # transformers' own text is about converting slow tokenizers or JSON columns; say what is wrong instead.
        raise ModelFolderError(tokenizer_folder_problem(folder)
                               or f"tokenizer folder '{folder}' cannot be loaded: {exc}") from None
    if tokenizer.pad_token is None:
        if not pad_to_eos:
            raise ModelFolderError(f"tokenizer in '{folder}' has no pad token; add one to the tokenizer, or let "
                                   f"the end-of-sequence token pad (pad_to_eos=True)")
        if tokenizer.eos_token is None:
            raise ModelFolderError(f"tokenizer in '{folder}' has neither a pad token nor an end-of-sequence token")
        logger.warning("tokenizer in '%s' has no pad token: padding with the end-of-sequence token %r",
                       folder, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


DISTILL_ADVICE = "distill from a teacher of the same model family and tokenizer"
REWARD_MODEL_ADVICE = ("a reward model scores the policy's token ids: train it from the policy's model (hpc-rlhf rm), "
                       "or serve it over HTTP (hpc-rlhf serve-rm and reward.http_url: it tokenises the text itself)")


def same_tokenizer_problem(student: str | Path, teacher: str | Path, student_key: str = "actor.path",
                           teacher_key: str = "distill.teacher", advice: str = DISTILL_ADVICE) -> str | None:
    """Why a teacher cannot score a student's tokens, or None: its tokenizer must map every token to the same id
    (a teacher with another vocabulary would score other tokens than those sampled) and end sequences with the
    same token. Both folders are named."""
    ours, theirs = load_tokenizer(student, pad_to_eos=True), load_tokenizer(teacher, pad_to_eos=True)
    head = f"{teacher_key} '{teacher}' does not share the tokenizer of {student_key} '{student}'"
    vocabulary, other = ours.get_vocab(), theirs.get_vocab()
    if vocabulary != other:
        differ = sorted(t for t in set(vocabulary) | set(other) if vocabulary.get(t) != other.get(t))
        shown = ", ".join(f"{t!r}: {vocabulary.get(t)} vs {other.get(t)}" for t in differ[:3])
        return f"{head}: {len(vocabulary)} vs {len(other)} tokens, {len(differ)} mapped differently ({shown}); {advice}"
    if ours.eos_token_id != theirs.eos_token_id:
        return f"{head}: end-of-sequence token {ours.eos_token_id} vs {theirs.eos_token_id}"
    return None


def reward_model_tokenizer_problem(policy: str | Path, reward_model: str | Path, policy_key: str,
                                   reward_model_key: str) -> str | None:
    """Why a reward model cannot score the policy's token ids, or None: it must share the policy's tokenizer
    (same_tokenizer_problem). A reward model folder without tokenizer files cannot be compared and passes: what it
    was trained with is unknown here."""
    if tokenizer_folder_problem(Path(reward_model)) is not None:
        return None
    return same_tokenizer_problem(policy, reward_model, policy_key, reward_model_key, advice=REWARD_MODEL_ADVICE)


def same_output_width_problem(student: str | Path, teacher: str | Path, student_key: str = "model.path",
                              teacher_key: str = "kd.teacher") -> str | None:
    """Why a teacher's next-token distributions cannot be set beside a student's, or None: knowledge distillation
    compares them word by word, so both output layers must have the same width (their configs' `vocab_size`,
    which a shared tokenizer does not fix: families pad it to different multiples). Both folders are named."""
    widths = [read_model_config(check_model_folder(folder)).get_text_config().vocab_size
              for folder in (student, teacher)]
    if widths[0] == widths[1]:
        return None
    return (f"{teacher_key} '{teacher}' has {widths[1]} output tokens (vocab_size in its config.json) and "
            f"{student_key} '{student}' {widths[0]}: the teacher's next-token distributions must be as wide as "
            f"the student's")


def build_causal_lm(model_cfg: ModelSection, for_training: bool = True, device: torch.device | str | None = None,
                    where: str = "model"):
    """The actor or reference model: `AutoModelForCausalLM` from `model_cfg.path`.

    dtype `auto` is bf16 on CUDA and fp32 on the CPU. With `for_training`, gradient checkpointing (if asked)
    is on, the KV cache is off, and LoRA adapters are added when `model.lora.rank > 0`; without it the model
    is frozen in eval mode. `device` moves the model there (left on the CPU when None: DeepSpeed moves it).
    `where`: the config section of `model_cfg` (`model`, `actor`), named by errors about its LoRA settings.
    """
    folder = check_model_folder(model_cfg.path)
    config = read_model_config(folder)
    check_causal_lm_config(folder, config)
    kwargs = pretrained_kwargs(model_cfg, device)
    model, missing = load_pretrained(AutoModelForCausalLM, folder, "a causal language model", **kwargs)
    check_nothing_missing(folder, missing)
    if device is not None and "device_map" not in kwargs:
        model.to(device)
    prepare_model(model, model_cfg, for_training)
    if for_training and model_cfg.lora.rank > 0:
        model = apply_lora(model, model_cfg.lora, task="causal_lm",
                           gradient_checkpointing=model_cfg.gradient_checkpointing, where=f"{where}.lora")
    return model


def model_num_params(model, trainable_only: bool = False) -> int:
    """Number of parameters (full sizes also under ZeRO-3, where each rank holds only a shard)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
               if p.requires_grad or not trainable_only)
