"""Tokenised training examples as plain dicts of int lists, and the collators that turn them into tensors.

Labels follow the Hugging Face convention: `labels[t]` is the token at position t, or -100 where no loss is
taken (prompt tokens, user/system turns, padding); the model shifts them by one itself.

Truncation policy (the same for every mode):
- A prompt longer than `max_prompt_len` tokens keeps its LAST `max_prompt_len` tokens: the question usually
  sits at the end of a prompt, the context at the start. (The BOS token and a chat template's system header are
  cut with the rest in that case.)
- The response is cut to `max_len - prompt length` tokens; a cut response loses its final EOS, so the model is
  never taught to stop where the text did not stop.
- Plain text (no chat template): the prompt is tokenised with the tokenizer's special tokens (BOS, if it adds
  one), the response without, and EOS is appended to the response.
- Chat template: the template's own markers are the text; nothing is added. The template's end-of-turn token
  ends each assistant turn (generation must stop on it; for instruct tokenizers it is the EOS token).
- Multi-turn chats (`messages`): everything before the first assistant turn is the prompt; the rest of the
  conversation is cut at `max_len`, and every assistant turn in what remains is trained on.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from hpc_rlhf.data.loading import BAD_LABEL, BadRowReport
from hpc_rlhf.data.templates import (TemplateError, as_messages, check_messages, encode_many, prompt_text,
                                     render_chat, tokenize_chat, tokenizer_name)

IGNORE_INDEX = -100


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def _check_limits(max_len: int, max_prompt_len: int) -> None:
    if max_prompt_len < 1 or max_len <= max_prompt_len:
        raise ValueError(f"need 1 <= max_prompt_len < max_len so that a response fits, got max_prompt_len="
                         f"{max_prompt_len}, max_len={max_len} (data.max_prompt_len, data.max_len)")


def _eos_id(tokenizer, where: str) -> int:
    if tokenizer.eos_token_id is None:
        raise TemplateError(f"{_at(where)}tokenizer '{tokenizer_name(tokenizer)}' has no EOS token to end "
                            f"responses with")
    return int(tokenizer.eos_token_id)


def _assemble(prompt_ids: list[int], rest_ids: list[int], rest_labels: list[int], max_len: int,
              max_prompt_len: int) -> dict[str, Any]:
    """Apply the truncation policy to (prompt, rest) and lay out ids and labels."""
    prompt_ids = prompt_ids[-max_prompt_len:]
    room = max_len - len(prompt_ids)
    return {
        "input_ids": prompt_ids + rest_ids[:room],
        "labels": [IGNORE_INDEX] * len(prompt_ids) + rest_labels[:room],
        "prompt_len": len(prompt_ids),
    }


def _prompt_and_response_texts(tokenizer, prompt: str | Sequence[dict], response: str, chat_template: bool,
                               where: str) -> tuple[str, str]:
    """The prompt's text and the response's, tokenised apart (plain: as they are; chat: the prompt's render and
    what the response adds to it)."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise TemplateError(f"{_at(where)}a list of messages needs the chat template "
                                f"(data.apply_chat_template=true)")
        return prompt, response
    # Tokenising the prompt render on its own keeps its ids identical to what `prompt_example` gives generation.
    head = prompt_text(tokenizer, prompt, chat_template=True, where=where)
    full = render_chat(tokenizer, as_messages(prompt, response), where=where)
    if not full.startswith(head):
        raise TemplateError(f"{_at(where)}the chat template of tokenizer '{tokenizer_name(tokenizer)}' renders "
                            f"the prompt differently once the response is added, so the response cannot be "
                            f"separated from it")
    return head, full[len(head):]


def _wheres(wheres: Sequence[str] | None, rows: int) -> Sequence[str]:
    if wheres is None:
        return [""] * rows
    if len(wheres) != rows:
        raise ValueError(f"{len(wheres)} row places for {rows} rows")
    return wheres


def sft_examples(tokenizer, prompts: Sequence[str | Sequence[dict]], responses: Sequence[str], *, max_len: int,
                 max_prompt_len: int, chat_template: bool = False,
                 wheres: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """`sft_example` of many prompt/response rows (`wheres`: each row's place, for messages), the texts tokenised
    many at a time: the same examples as one call per row."""
    _check_limits(max_len, max_prompt_len)
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    wheres = _wheres(wheres, len(prompts))
    texts = [_prompt_and_response_texts(tokenizer, prompt, response, chat_template, where)
             for prompt, response, where in zip(prompts, responses, wheres)]
    # Plain text: the prompt with the tokenizer's special tokens (BOS), the response without, then EOS.
    heads = encode_many(tokenizer, [head for head, _ in texts], add_special_tokens=not chat_template)
    tails = encode_many(tokenizer, [tail for _, tail in texts], add_special_tokens=False)
    end = [] if chat_template or not texts else [_eos_id(tokenizer, wheres[0])]
    return [_assemble(head, tail + end, tail + end, max_len, max_prompt_len) for head, tail in zip(heads, tails)]


def sft_example(tokenizer, *, prompt: str | Sequence[dict] | None = None, response: str | None = None,
                messages: Sequence[dict] | None = None, max_len: int, max_prompt_len: int,
                chat_template: bool = False, where: str = "") -> dict[str, Any]:
    """One SFT example -> {"input_ids", "labels", "prompt_len"} (see the module's truncation policy).

    Either `prompt` and `response` (labels on the response and its EOS), or `messages` (a chat; labels on every
    assistant turn, which needs `chat_template=True`).
    """
    _check_limits(max_len, max_prompt_len)
    if messages is not None:
        if prompt is not None or response is not None:
            raise ValueError(f"{_at(where)}give either messages or prompt and response, not both")
        if not chat_template:
            raise TemplateError(f"{_at(where)}a list of messages needs the chat template "
                                f"(data.apply_chat_template=true)")
        ids, ranges = tokenize_chat(tokenizer, check_messages(messages, where), where=where)
        labels = [IGNORE_INDEX] * len(ids)
        for start, end in ranges:
            labels[start:end] = ids[start:end]
        first = ranges[0][0]
        return _assemble(ids[:first], ids[first:], labels[first:], max_len, max_prompt_len)
    if prompt is None or response is None:
        raise ValueError(f"{_at(where)}an SFT example needs prompt and response, or messages")
    return sft_examples(tokenizer, [prompt], [response], max_len=max_len, max_prompt_len=max_prompt_len,
                        chat_template=chat_template, wheres=[where])[0]


def preference_examples(tokenizer, prompts: Sequence[str | Sequence[dict]], chosen: Sequence[str],
                        rejected: Sequence[str], *, max_len: int, max_prompt_len: int, chat_template: bool = False,
                        wheres: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """`preference_example` of many rows, tokenised many at a time (see sft_examples)."""
    sides = [sft_examples(tokenizer, prompts, texts, max_len=max_len, max_prompt_len=max_prompt_len,
                          chat_template=chat_template, wheres=wheres) for texts in (chosen, rejected)]
    return [{
        "chosen_input_ids": good["input_ids"],
        "chosen_labels": good["labels"],
        "rejected_input_ids": bad["input_ids"],
        "rejected_labels": bad["labels"],
        "prompt_len": good["prompt_len"],
    } for good, bad in zip(*sides)]


def preference_example(tokenizer, *, prompt: str | Sequence[dict], chosen: str, rejected: str, max_len: int,
                       max_prompt_len: int, chat_template: bool = False, where: str = "") -> dict[str, Any]:
    """A preference pair -> {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels",
    "prompt_len"}; both share the same (truncated) prompt, and labels cover the response tokens only."""
    return preference_examples(tokenizer, [prompt], [chosen], [rejected], max_len=max_len,
                               max_prompt_len=max_prompt_len, chat_template=chat_template, wheres=[where])[0]


def kto_examples(tokenizer, prompts: Sequence[str | Sequence[dict]], responses: Sequence[str],
                 labels: Sequence[bool | int], *, max_len: int, max_prompt_len: int, chat_template: bool = False,
                 wheres: Sequence[str] | None = None, skipped: BadRowReport | None = None) -> list[dict[str, Any]]:
    """`kto_example` of many rows, tokenised many at a time (see sft_examples). With `skipped` (data.on_bad_row
    =skip), a row whose label is not true/false is counted there and left out instead of raising."""
    wheres = _wheres(wheres, len(prompts))
    keep = []
    for i, (label, where) in enumerate(zip(labels, wheres)):
        if isinstance(label, bool) or label in (0, 1):
            keep.append(i)
            continue
        message = f"{_at(where)}a KTO label must be true/false (or 1/0), got {label!r}"
        if skipped is None:
            raise ValueError(message)
        skipped.drop(BAD_LABEL, message)
    examples = sft_examples(tokenizer, [prompts[i] for i in keep], [responses[i] for i in keep], max_len=max_len,
                            max_prompt_len=max_prompt_len, chat_template=chat_template,
                            wheres=[wheres[i] for i in keep])
    for example, i in zip(examples, keep):
        example["label"] = bool(labels[i])
    return examples


def kto_example(tokenizer, *, prompt: str | Sequence[dict], response: str, label: bool | int, max_len: int,
                max_prompt_len: int, chat_template: bool = False, where: str = "") -> dict[str, Any]:
    """A KTO example -> the SFT fields plus "label" (True = desirable response)."""
    return kto_examples(tokenizer, [prompt], [response], [label], max_len=max_len, max_prompt_len=max_prompt_len,
                        chat_template=chat_template, wheres=[where])[0]


def single_token_id(tokenizer, text: str, key: str) -> int:
    """The id of `text` when the tokenizer writes it as exactly one token, else a ValueError naming `key`."""
    ids = encode_many(tokenizer, [text], add_special_tokens=False)[0]
    if len(ids) != 1:
        raise ValueError(f"{key}={text!r} is {len(ids)} tokens for tokenizer '{tokenizer_name(tokenizer)}' "
                         f"({ids}); it must be exactly one")
    return ids[0]


def process_reward_examples(tokenizer, texts: Sequence[str], labels: Sequence[Sequence], *, marker_id: int,
                            reward_tokens: Sequence[str], max_len: int, wheres: Sequence[str] | None = None,
                            skipped: BadRowReport | None = None) -> list[dict[str, Any]]:
    """Worked solutions with a marker token after each step and one label per marker -> {"input_ids",
    "marker_positions", "marker_targets"}: where each marker is, and what the model should put after it, as
    probabilities over `reward_tokens`. A label is one of the reward tokens (that token's probability 1) or, with
    two reward tokens, a number in [0, 1]: the probability of the first (a soft label, e.g. the share of
    rollouts from that step that reached the right answer). The text is tokenised with the tokenizer's special
    tokens (BOS) and cut at `max_len`; markers cut off go with their labels. Each bad row is named by `wheres`;
    with `skipped` (data.on_bad_row=skip) it is counted there and left out instead of raising."""
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts for {len(labels)} label lists")
    wheres = _wheres(wheres, len(texts))
    examples = []
    for ids, row_labels, where in zip(encode_many(tokenizer, texts, add_special_tokens=True), labels, wheres):
        try:
            examples.append(_process_reward_example(ids, row_labels, marker_id, reward_tokens, max_len, where))
        except ValueError as exc:
            if skipped is None:
                raise
            skipped.drop(BAD_LABEL, str(exc))
    return examples


def _process_reward_example(ids: list[int], row_labels, marker_id: int, reward_tokens: Sequence[str], max_len: int,
                            where: str) -> dict[str, Any]:
    positions = [i for i, token in enumerate(ids) if token == marker_id]
    if not isinstance(row_labels, (list, tuple)) or len(row_labels) != len(positions):
        count = len(row_labels) if isinstance(row_labels, (list, tuple)) else repr(row_labels)
        raise ValueError(f"{_at(where)}{count} labels for {len(positions)} step markers: a process reward row "
                         f"needs one label per marker")
    targets = [_step_target(label, reward_tokens, where) for label in row_labels]
    kept = sum(position < max_len for position in positions)
    if kept == 0:
        raise ValueError(f"{_at(where)}no step marker within the first {max_len} tokens (data.max_len)")
    return {"input_ids": ids[:max_len], "marker_positions": positions[:kept], "marker_targets": targets[:kept]}


def _step_target(label, reward_tokens: Sequence[str], where: str) -> list[float]:
    if isinstance(label, str):
        if label not in reward_tokens:
            raise ValueError(f"{_at(where)}step label {label!r} is none of the reward tokens {list(reward_tokens)}")
        return [1.0 if token == label else 0.0 for token in reward_tokens]
    if isinstance(label, (int, float)) and not isinstance(label, bool) and 0.0 <= label <= 1.0:
        if len(reward_tokens) != 2:
            raise ValueError(f"{_at(where)}a numeric step label ({label}) needs exactly two reward tokens, "
                             f"got {list(reward_tokens)}")
        return [float(label), 1.0 - float(label)]
    raise ValueError(f"{_at(where)}a step label must be one of {list(reward_tokens)} or a number in [0, 1], "
                     f"got {label!r}")


def prompt_examples(tokenizer, prompts: Sequence[str | Sequence[dict]], *, max_prompt_len: int,
                    chat_template: bool = False, wheres: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """`prompt_example` of many prompts, tokenised many at a time (see sft_examples)."""
    texts = [prompt_text(tokenizer, prompt, chat_template=chat_template, where=where)
             for prompt, where in zip(prompts, _wheres(wheres, len(prompts)))]
    kept = [ids[-max_prompt_len:] for ids in encode_many(tokenizer, texts, add_special_tokens=not chat_template)]
    return [{"input_ids": ids, "prompt_len": len(ids)} for ids in kept]


def prompt_example(tokenizer, *, prompt: str | Sequence[dict], max_prompt_len: int, chat_template: bool = False,
                   where: str = "") -> dict[str, Any]:
    """A prompt for generation -> {"input_ids", "prompt_len"}, keeping its last `max_prompt_len` tokens."""
    return prompt_examples(tokenizer, [prompt], max_prompt_len=max_prompt_len, chat_template=chat_template,
                           wheres=[where])[0]


# ------------------------------------------------------------------------------------------------ collators
def _pad(rows: Sequence[Sequence[int]], value: int, length: int, side: str) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if not row:
            continue
        if side == "right":
            out[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        else:
            out[i, length - len(row):] = torch.as_tensor(row, dtype=torch.long)
    return out


def pad_collate(batch: Sequence[Mapping[str, Any]], pad_id: int, side: str = "right") -> dict[str, Any]:
    """Examples -> {"input_ids", "attention_mask", "labels" (if given, -100 on padding), "prompt_lens" (if given)}.

    side="left" lines prompts up at their last token, as generation wants. Other per-example numbers (e.g. the
    KTO "label") become tensors under their own name; anything else is passed on as a list.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not batch:
        raise ValueError("cannot collate an empty batch")
    ids = [example["input_ids"] for example in batch]
    length = max(len(row) for row in ids)
    out: dict[str, Any] = {
        "input_ids": _pad(ids, pad_id, length, side),
        "attention_mask": _pad([[1] * len(row) for row in ids], 0, length, side),
    }
    for key in batch[0]:
        if key == "input_ids":
            continue
        values = [example[key] for example in batch]
        if key == "labels":
            out["labels"] = _pad(values, IGNORE_INDEX, length, side)
        elif key == "prompt_len":
            out["prompt_lens"] = torch.tensor(values, dtype=torch.long)
        elif all(isinstance(v, (bool, int, float)) for v in values):
            out[key] = torch.tensor(values)
        else:
            out[key] = values
    return out


def pair_collate(batch: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, Any]:
    """Preference pairs -> one padded batch of 2B rows: the B chosen rows first, then the B rejected rows."""
    rows = [{"input_ids": ex[f"{side}_input_ids"], "labels": ex[f"{side}_labels"], "prompt_len": ex["prompt_len"]}
            for side in ("chosen", "rejected") for ex in batch]
    return pad_collate(rows, pad_id, side="right")


def shared_prompt_pair_collate(batch: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, Any]:
    """Preference pairs -> B rows, each the prompt once, then the chosen response, then the rejected one.

    The rejected response's positions continue from the prompt (as in its own row) and a 4D boolean
    `attention_mask` (B, 1, T, T), True = may attend, keeps it from seeing the chosen response: every token sees
    what it would see in its own row, so the scores are those of `pair_collate`'s 2B rows, for the prompt's
    tokens once instead of twice. Padding at the end of a row attends to itself only (no row of the mask is empty,
    which would give NaN). `chosen_last` / `rejected_last`: (B,) index of each side's last token;
    `tokens`: the real tokens of the batch."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    rows, positions, chosen_last, rejected_last = [], [], [], []
    for ex in batch:
        prompt_len, chosen, rejected = ex["prompt_len"], ex["chosen_input_ids"], ex["rejected_input_ids"]
        if chosen[:prompt_len] != rejected[:prompt_len]:
            raise ValueError("a preference pair whose chosen and rejected rows start with different prompts cannot "
                             "share its prompt")
        rows.append(list(chosen) + list(rejected[prompt_len:]))
        positions.append(list(range(len(chosen))) + list(range(prompt_len, len(rejected))))
        chosen_last.append(len(chosen) - 1)
        rejected_last.append(len(rows[-1]) - 1)
    length = max(len(row) for row in rows)
    steps = torch.arange(length)
    causal = steps[None, :] <= steps[:, None]  # (query, key)
    lengths = torch.tensor([len(row) for row in rows])
    chosen_end = torch.tensor(chosen_last) + 1
    prompt_lens = torch.tensor([ex["prompt_len"] for ex in batch])
    query, key = steps[None, :, None], steps[None, None, :]
    # A rejected token (query >= chosen_end) may not see the chosen response (prompt_len <= key < chosen_end).
    hides_chosen = (query >= chosen_end[:, None, None]) & (key >= prompt_lens[:, None, None]) & \
        (key < chosen_end[:, None, None])
    padding = query >= lengths[:, None, None]
    allowed = causal[None] & ~hides_chosen & ~(padding & (key != query))
    return {
        "input_ids": _pad(rows, pad_id, length, "right"),
        "position_ids": _pad(positions, 0, length, "right"),
        "attention_mask": allowed[:, None],
        "chosen_last": torch.tensor(chosen_last),
        "rejected_last": torch.tensor(rejected_last),
        "tokens": int(lengths.sum()),
    }
