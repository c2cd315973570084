"""What the data tests share: a character-level tokenizer with a ChatML-like chat template, the ids it gives
plain characters, and a five-turn chat."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
# A ChatML-like template that, like real ones, refuses roles it does not know.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE, folder=None):
    """A character-level tokenizer (one id per character, special tokens whole) that adds BOS to plain text.

    With `folder`, it is saved there and reloaded, so that it has a name like a real tokenizer folder.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(SPECIALS)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    if folder is None:
        return tokenizer
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def char_ids(text: str) -> list[int]:
    """The ids the tiny tokenizer gives plain characters (no special tokens), computed from its vocabulary."""
    offset = len(SPECIALS)
    return [offset + CHARS.index(c) for c in text]


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "1+1"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+3"},
    {"role": "assistant", "content": "5!"},
]
