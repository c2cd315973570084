"""The built-in tiny assets: a character-level tokenizer and small model configs kept in the repository.

Compute nodes have no internet, and tests must not depend on a model hub, so the tiny models are made from
files committed next to this module (hpc_rlhf/models/tiny/):

    tokenizer/          the saved tokenizer (tokenizer.json, tokenizer_config.json), rebuilt by build_tokenizer()
    llama-tiny.json     model configs: only the keys that differ from the family's defaults
    qwen2-tiny.json
    mistral-tiny.json
    mixtral-tiny.json

`make_model_folder` turns a config into an ordinary Hugging Face folder (config, seeded random weights as
safetensors, tokenizer), so every other part of the project loads tiny models the way it loads a 70B one:
`AutoTokenizer.from_pretrained(folder)` and `AutoModelForCausalLM.from_pretrained(folder)`.

Run `python -m hpc_rlhf.models.tiny` to rewrite the committed tokenizer files after changing the builder.

torch, tokenizers and transformers (about three seconds to import) are imported inside the functions that build
things: hpc_rlhf.data.assets imports this module at every run to check whether the assets are up to date, which
needs only the names and paths above.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import string
import sys
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "tiny"
TOKENIZER_DIR = TINY_DIR / "tokenizer"
MODEL_NAMES = ("llama-tiny", "qwen2-tiny", "mistral-tiny", "mixtral-tiny")

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_MARKERS.values())  # ids 0.. in this order; <pad> must be id 0
# Every printable ASCII character plus newline and tab: any English text, code or arithmetic round-trips.
CHARACTERS = tuple(string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation
                   + " \n\t")

# Each message is its role marker, its content and <eos>; the model learns to stop a turn by emitting <eos>,
# which is also what generation stops on. The `generation` block marks assistant text so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` can train on the assistant's turns only.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('chat role must be system, user or assistant, got ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def build_tokenizer():
    """The character-level tokenizer, built from scratch with the `tokenizers` library.

    Every character is its own token, so `decode(encode(text))` gives back `text` exactly for any printable
    ASCII text. Like Llama tokenizers it puts <bos> in front of each encoded text (add_special_tokens=True)
    and never appends <eos> by itself: data code adds <eos> where a response ends.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One piece per character (the regex "." would skip newlines, hence the explicit class).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the pieces with nothing in between (the default decoder would put spaces between tokens).
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        extra_special_tokens=list(ROLE_MARKERS.values()), add_bos_token=True, add_eos_token=False,
        model_max_length=128, padding_side="right", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer, out_dir: str | Path) -> Path:
    """Save as JSON files only (the chat template inside tokenizer_config.json), which the package ships."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir


def copy_tokenizer(out_dir: str | Path) -> Path:
    """Copy the committed tokenizer files into `out_dir` (byte for byte)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(TOKENIZER_DIR.iterdir()):
        if path.is_file():
            shutil.copyfile(path, out_dir / path.name)
    return out_dir


def load_tokenizer():
    """The committed tokenizer, loaded the ordinary way."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def config_path(name: str) -> Path:
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown tiny model '{name}'; the tiny models are: {', '.join(MODEL_NAMES)}")
    return TINY_DIR / f"{name}.json"


def model_config(name: str):
    """The transformers config of a tiny model (family defaults + the keys in its JSON file)."""
    from transformers import AutoConfig

    path = config_path(name)
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path}: key 'model_type' is missing")
    return AutoConfig.for_model(model_type, **values)


def make_model_folder(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a Hugging Face model folder: config, random weights drawn from `seed`, tokenizer.

    The same name and seed give the same tensors (and the same safetensors bytes with the same
    torch/transformers versions). The caller's global RNG state is left as it was.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with _quiet_progress():
        model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(out_dir)
    return out_dir


@contextlib.contextmanager
def _quiet_progress():
    """No progress bar for writing a one-megabyte file; restore the caller's setting afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Rewrite the committed tokenizer files from `build_tokenizer()`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv:
        print("usage: python -m hpc_rlhf.models.tiny   (rewrites hpc_rlhf/models/tiny/tokenizer/)",
              file=sys.stderr)
        return 2
    if TOKENIZER_DIR.exists():
        shutil.rmtree(TOKENIZER_DIR)
    save_tokenizer(build_tokenizer(), TOKENIZER_DIR)
    print(f"wrote {TOKENIZER_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
