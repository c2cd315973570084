"""Typed configuration: dataclasses, YAML files and `key=value` overrides with dotted keys.

Every mode describes its configuration as a tree of dataclasses. `load_config(ModeConfig, path, overrides)`
reads the YAML file, applies the overrides in order and checks every value against the field's type and its
metadata (`choices`, `min`, `max`). Mistakes are reported with the dotted key and, for unknown keys, the
nearest valid name, so a typo in a 70B job fails in a second instead of after an hour of queueing.

Field metadata understood here:
    help     one line shown by `--help`
    choices  allowed values
    min/max  inclusive bounds for numbers

Keys named `output_dir` (a folder a run creates) and `output_file` (a file it writes; empty = its default) are
checked when the configuration is loaded: a file where the folder should be, or in the way of its parents, is
named before any rank starts.

Length: just over 500 lines, because a key is typed, defaulted, range-checked and described in one place: the
loader and the sections every mode shares (model, data, train, log, checkpoint, dist) are read together, and
`--help` reads both.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml


class ConfigError(ValueError):
    """A configuration problem, always naming the key (and file or flag) it comes from."""


def field(default: Any = dataclasses.MISSING, *, help: str = "", choices: Iterable[Any] | None = None,
          min: float | None = None, max: float | None = None, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with the metadata this module checks."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if min is not None:
        metadata["min"] = min
    if max is not None:
        metadata["max"] = max
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    if dataclasses.is_dataclass(default):
        cls = type(default)
        return dataclasses.field(default_factory=cls, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls):
    """A nested config section whose defaults are those of `cls`."""
    return dataclasses.field(default_factory=cls, metadata={"help": (cls.__doc__ or "").strip().splitlines()[0]
                                                            if cls.__doc__ else ""})


# ----------------------------------------------------------------------------------------------- introspection
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return False, tp


def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a config class."""
    keys = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """What is known of one leaf key: `--help` prints key, default and meaning (with the choices); the generated
    configuration reference (scripts/docs_hooks.py) adds the type and the range."""
    key: str
    type: str       # e.g. int, float, str or null, list[str]
    default: str    # as YAML, on one line
    choices: tuple  # () when any value of the type goes
    min: float | None
    max: float | None
    help: str       # the field's help, without the choices


def _type_text(tp) -> str:
    optional, inner = _is_optional(tp)
    origin = typing.get_origin(inner)
    if origin in (list, tuple):
        (item,) = typing.get_args(inner)[:1] or (Any,)
        text = f"list[{_type_text(item)}]"
    elif origin is dict:
        text = "mapping"
    elif origin in (typing.Union, types.UnionType):
        text = " or ".join(_type_text(a) for a in typing.get_args(inner))
    else:
        text = _type_name(inner)
    return f"{text} or null" if optional else text


def key_infos(cls) -> list[KeyInfo]:
    """Every leaf key of a config class with its type, default, choices, range and help, in declaration order."""
    infos = []

    def walk(obj, klass, prefix):
        hints = _hints(klass)
        for f in dataclasses.fields(klass):
            tp = hints[f.name]
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(tp):
                walk(value, tp, f"{prefix}{f.name}.")
                continue
            shown = yaml.safe_dump(value, default_flow_style=True).strip()
            if shown.endswith("\n..."):
                shown = shown[:-4]
            shown = shown.removesuffix("...").strip()
            infos.append(KeyInfo(prefix + f.name, _type_text(tp), shown, tuple(f.metadata.get("choices", ())),
                                 f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("help", "")))

    walk(cls(), cls, "")
    return infos


def describe(cls) -> list[tuple[str, str, str]]:
    """(dotted key, default as YAML, help) for every leaf key: what `--help` prints."""
    rows = []
    for info in key_infos(cls):
        extra = " [" + "|".join(str(c) for c in info.choices) + "]" if info.choices else ""
        rows.append((info.key, info.default, (info.help + extra).strip()))
    return rows


def format_help(cls) -> str:
    rows = describe(cls)
    width = max(len(k) for k, _, _ in rows)
    dwidth = min(24, max(len(d) for _, d, _ in rows))
    return "\n".join(f"  {k:<{width}}  {d:<{dwidth}}  {h}" for k, d, h in rows)


# --------------------------------------------------------------------------------------------------- coercion
def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where it is lossless (int -> float)."""
    optional, inner = _is_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise ConfigError(f"{where}: key '{key}' must be {_type_name(inner)}, not null")
    tp = inner
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: key '{key}' must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: key '{key}' has value {value!r} of the wrong type "
                          f"(expected {' or '.join(_type_name(a) for a in typing.get_args(tp))})")
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and item_tp is not Any:
            value = [value]  # a single value where a list is expected: a list of one
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: key '{key}' must be a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: key '{key}' must be a mapping, got {value!r}")
        _, vt = typing.get_args(tp) or (Any, Any)
        return {str(k): _coerce(v, vt, f"{key}.{k}", where) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: key '{key}' must be a string, got {value!r}")
    return value


def _check_metadata(value: Any, f: dataclasses.Field, key: str, where: str) -> None:
    meta = f.metadata
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{where}: key '{key}' must be one of {list(meta['choices'])}, got {value!r}")
    if "min" in meta and isinstance(value, (int, float)) and value < meta["min"]:
        raise ConfigError(f"{where}: key '{key}' must be >= {meta['min']}, got {value!r}")
    if "max" in meta and isinstance(value, (int, float)) and value > meta["max"]:
        raise ConfigError(f"{where}: key '{key}' must be <= {meta['max']}, got {value!r}")


def _unknown(key: str, cls) -> ConfigError:
    valid = all_keys(cls)
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not near:  # a right leaf name under the wrong section ('lr' for 'train.lr')
        leaf = key.rsplit(".", 1)[-1]
        near = [k for k in valid if k.rsplit(".", 1)[-1] == leaf][:1]
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"unknown key '{key}'{hint}")


# ------------------------------------------------------------------------------------------------------ build
def from_dict(cls, data: Mapping[str, Any], where: str = "config", _prefix: str = "", _root=None):
    """Build `cls` from a nested mapping; keys not given keep their defaults."""
    root = _root or cls
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: section '{_prefix.rstrip('.') or '<top>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{_prefix}{name}"
        if name not in fields:
            raise ConfigError(f"{where}: {_unknown(key, root)}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            # Start from this mode's default section (it may differ from the section class's defaults).
            merged = _deep_merge(_default_tree(fields[name]), value if value is not None else {}, where, key)
            kwargs[name] = from_dict(tp, merged, where, key + ".", root)
        else:
            coerced = _coerce(value, tp, key, where)
            _check_metadata(coerced, fields[name], key, where)
            kwargs[name] = coerced
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # a required field without a value
        raise ConfigError(f"{where}: {exc}") from None
    _check_all(obj, where, _prefix)
    return obj


def _default_tree(f: dataclasses.Field) -> dict[str, Any]:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.asdict(f.default_factory())
    if dataclasses.is_dataclass(f.default):
        return dataclasses.asdict(f.default)
    return {}


def _deep_merge(base: dict[str, Any], given: Any, where: str, key: str) -> Any:
    if not isinstance(given, Mapping):
        return given  # reported as "must be a mapping" by from_dict
    out = dict(base)
    for k, v in given.items():
        out[k] = _deep_merge(base[k], v, where, f"{key}.{k}") if isinstance(base.get(k), dict) else v
    return out


def _check_all(obj, where: str, prefix: str) -> None:
    """Check defaults too, and let a section validate relations between its own keys (`validate()`)."""
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-5` -> ("train.lr", 1e-05). Values are read as YAML, so lists and booleans work."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and value.lower() in ("none", "null", "~"):
        value = None
    # YAML reads 1e-5 as a string (no dot); numbers are what the user means.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return key, value


def _set_dotted(tree: dict, key: str, value: Any, cls) -> None:
    parts = key.split(".")
    valid = set(all_keys(cls))
    sections = {k.rsplit(".", 1)[0] for k in valid if "." in k}
    if key not in valid and not (key in sections and isinstance(value, Mapping)):
        raise _unknown(key, cls)
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line naming the file, line and column (PyYAML's own text says "<unicode string>" for the file)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return ConfigError(f"{path}: not valid YAML: {exc}")
    mark = exc.problem_mark
    context = ""
    if exc.context:
        start = exc.context_mark
        context = f" ({exc.context}" + (f" at line {start.line + 1}, column {start.column + 1})" if start else ")")
    return ConfigError(f"{path}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: "
                       f"{exc.problem}{context}")


def read_yaml_file(path: Path) -> Any:
    """The parsed YAML file; unreadable files and syntax errors as one ConfigError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a YAML text file (byte {exc.start} is not UTF-8)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None


def check_output_path(value: str, key: str, where: str, folder: bool) -> None:
    """`value` can be created as a folder (`folder`) or written as a file: nothing of the other kind is in its
    place, and no file stands where one of its parent folders should be."""
    if not value:
        return
    path = Path(value)
    if folder and path.exists() and not path.is_dir():
        raise ConfigError(f"{where}: {key}='{value}' is a file, not a folder; choose another {key}")
    if not folder and path.is_dir():
        raise ConfigError(f"{where}: {key}='{value}' is a folder; give the path of a file")
    for parent in path.parents:
        if parent.is_dir():
            return
        if parent.exists():
            raise ConfigError(f"{where}: {key}='{value}' cannot be created: '{parent}' is a file, not a folder")


def _check_output_paths(obj, where_of_key) -> None:
    for key in all_keys(type(obj)):
        leaf = key.rsplit(".", 1)[-1]
        if leaf not in ("output_dir", "output_file"):
            continue
        value = obj
        for part in key.split("."):
            value = getattr(value, part)
        if isinstance(value, str):
            check_output_path(value, key, where_of_key(key), folder=leaf == "output_dir")


def load_config(cls, path: str | Path | None = None, overrides: Iterable[str] = ()):
    """YAML file (optional) + `key=value` overrides -> checked instance of `cls`."""
    tree: dict[str, Any] = {}
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        loaded = read_yaml_file(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(loaded).__name__}")
        tree = loaded
    # Validate the file on its own first so that its errors name the file.
    from_dict(cls, tree, where)
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        try:
            _set_dotted(tree, key, value, cls)
        except ConfigError as exc:
            raise ConfigError(f"command line: {exc}") from None
        overridden.add(key)
    cfg = from_dict(cls, tree, "command line" if overridden else where)
    _check_output_paths(cfg, lambda key: "command line" if any(key == k or key.startswith(k + ".")
                                                               for k in overridden) else where)
    return cfg


def to_dict(obj) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def save_config(obj, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))


# ===================================================================================== sections shared by modes
# Each mode's config is a dataclass made of these sections plus its own (see hpc_rlhf/trainers/config.py and
# hpc_rlhf/rl/config.py).
from dataclasses import dataclass  # noqa: E402

TINY_ASSETS = "examples/tiny/assets"


@dataclass
class LoraSection:
    """LoRA / QLoRA adapters (rank 0 = full fine-tuning)."""
    rank: int = field(0, help="LoRA rank; 0 trains all parameters", min=0)
    alpha: float = field(16.0, help="LoRA alpha (scale = alpha / rank)", min=0)
    dropout: float = field(0.0, help="dropout on the LoRA path", min=0, max=1)
    target_modules: list[str] = field(["q_proj", "k_proj", "v_proj", "o_proj"], help="module names to adapt")
    load_in_4bit: bool = field(False, help="QLoRA: base weights in 4-bit (bitsandbytes, GPU only)")
    merge_on_save: bool = field(True, help="save the final model with adapters merged into the weights")


@dataclass
class ModelSection:
    """The model to train (a local Hugging Face folder)."""
    path: str = field(f"{TINY_ASSETS}/models/llama-tiny", help="local Hugging Face model folder")
    tokenizer: str | None = field(None, help="tokenizer folder (default: the model folder)")
    attn_implementation: str = field("sdpa", choices=["sdpa", "eager", "flash_attention_2"],
                                     help="attention kernel")
    dtype: str = field("auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto = bfloat16 on GPU, float32 on CPU")
    gradient_checkpointing: bool = field(False, help="recompute activations in the backward pass")
    init_value_head: bool = field(True, help="value models: start a new scalar head when the folder has none")
    lora: LoraSection = section(LoraSection)


@dataclass
class DataSection:
    """Training and evaluation data: local json/jsonl/parquet/csv files or saved `datasets` folders."""
    train_files: list[str] = field([], help="training data files or folders")
    eval_files: list[str] = field([], help="held-out data files or folders")
    prompt_key: str = field("prompt", help="column with the prompt text")
    response_key: str = field("response", help="column with the response text (SFT)")
    chosen_key: str = field("chosen", help="column with the preferred response")
    rejected_key: str = field("rejected", help="column with the dispreferred response")
    label_key: str = field("label", help="column with the desirable (true) / undesirable (false) label (KTO)")
    messages_key: str = field("messages", help="column with a chat as a list of {role, content}")
    answer_key: str = field("answer", help="column with the reference answer (rule rewards, evaluation)")
    apply_chat_template: bool = field(False, help="wrap prompts with the tokenizer's chat template")
    max_len: int = field(64, help="longest sequence in tokens (prompt + response)", min=2)
    max_prompt_len: int = field(32, help="longest prompt in tokens; longer prompts are cut from the left", min=1)
    packing: bool = field(False, help="pack several sequences into one row (no cross-sequence attention)")
    on_bad_row: str = field("error", choices=["error", "skip"], help="stop on a bad row, or skip and count it")
    max_train_rows: int | None = field(None, help="use at most this many training rows", min=1)
    max_eval_rows: int | None = field(256, help="evaluate on at most this many held-out rows", min=1)

    def validate(self) -> None:
        if self.max_prompt_len >= self.max_len:
            raise ConfigError(f"data.max_prompt_len ({self.max_prompt_len}) must be smaller than data.max_len "
                              f"({self.max_len}), which counts prompt and response together")


@dataclass
class TrainSection:
    """Optimisation and the DeepSpeed engine."""
    seed: int = field(0, help="seed for data order, initialisation and sampling")
    lr: float = field(1e-3, help="peak learning rate", min=0)
    min_lr_ratio: float = field(0.1, help="cosine decay floor as a fraction of lr", min=0, max=1)
    warmup_steps: int = field(10, help="linear warmup steps", min=0)
    max_steps: int = field(100, help="optimizer steps to run", min=1)
    micro_batch_size: int = field(16, help="sequences per rank per forward pass", min=1)
    batch_size: int = field(32, help="sequences per optimizer step over all ranks of the role", min=1)
    group_by_length: bool = field(False, help="one-model modes: sort each rank's rows of a step by length before "
                                  "cutting them into micro-batches (the same rows and gradient, less padding)")
    weight_decay: float = field(0.0, min=0)
    adam_beta1: float = field(0.9, min=0, max=1)
    adam_beta2: float = field(0.95, min=0, max=1)
    max_grad_norm: float = field(1.0, help="gradient clipping (0 = off)", min=0)
    zero_stage: int = field(0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    adam_offload: bool = field(False, help="keep Adam states on the CPU (pinned memory)")
    zero3_param_persistence_threshold: int = field(10000, min=0,
                                                   help="ZeRO-3 keeps parameters smaller than this unsharded")
    max_bad_steps: int = field(3, min=1, help="stop after this many non-finite steps in a row")


@dataclass
class LogSection:
    """Metrics, TensorBoard, progress."""
    every_steps: int = field(10, help="log metrics every N steps", min=1)
    eval_every_steps: int = field(50, help="evaluate on held-out data every N steps (0 = only at the end)",
                                  min=0)
    tensorboard: bool = field(True, help="write TensorBoard event files under output_dir/tb")
    wandb: str = field("off", choices=["off", "offline", "online"], help="Weights & Biases (when installed)")
    wandb_project: str = field("hpc_rlhf")
    progress: bool = field(True, help="tqdm progress bar on rank 0")


@dataclass
class CheckpointSection:
    """Checkpoints for resuming (output_dir/checkpoints)."""
    every_steps: int = field(0, help="save every N steps (0 = only at the end and on preemption)", min=0)
    keep: int = field(2, help="number of checkpoints to keep", min=1)
    resume: bool = field(True, help="continue from the newest complete checkpoint in output_dir")
    save_hf: bool = field(False, help="each checkpoint of every_steps also holds the trained models as Hugging Face "
                                      "folders (<checkpoint>/hf/<model>, as final/ is written), kept and pruned "
                                      "with it; none in a checkpoint a stop signal asked for, or at the last step")
    best_metric: str | None = field(None, help="an evaluation figure (eval_loss, eval_accuracy, ...): the model of "
                                               "its best evaluation so far is kept in output_dir/best/ (RL: the "
                                               "actor), replaced when a later one beats it (None = off)")
    best_mode: str = field("auto", choices=["auto", "max", "min"],
                           help="best_metric: higher or lower is better (auto: lower for a *loss, higher otherwise)")


@dataclass
class DistSection:
    """Process world (the launcher decides ranks; these are the knobs)."""
    backend: str = field("auto", choices=["auto", "gloo", "nccl"], help="auto = nccl with CUDA, else gloo")
    timeout_s: int = field(300, help="timeout of every collective, in seconds", min=1)
    nproc: int = field(1, help="ranks to start on this machine when no launcher started us", min=1)
    heartbeat_timeout_s: float = field(45.0, min=0,
                                       help="a rank silent this long ends the whole job (0 = no watchdog)")


# The frozen reference of the direct preference modes; its keys are here, beside the other shared sections, so that
# those modes' configs load without torch (the reference itself is runtime/reference.py).
REFERENCE_MODES = ("colocated", "precompute")


@dataclass
class ReferenceSection:
    """The frozen reference model of DPO/IPO/cDPO/KTO."""
    mode: str = field("colocated", choices=REFERENCE_MODES,
                      help="colocated: a frozen copy scores each batch; precompute: score all data once, then free it")
    path: str | None = field(None, help="reference model folder (default: model.path, the initial policy)")
