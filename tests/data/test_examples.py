import pytest
import torch

from hpc_rlhf.data import templates
from hpc_rlhf.data.examples import (IGNORE_INDEX, kto_example, kto_examples, pad_collate, pair_collate,
                                    preference_example, preference_examples, prompt_example, prompt_examples,
                                    shared_prompt_pair_collate, sft_example, sft_examples)
from hpc_rlhf.data.templates import TemplateError, encode, encode_many
from tests.data.conftest import CHAT, SPECIALS, char_ids, tiny_tokenizer

BOS, EOS, END = SPECIALS.index("<s>"), SPECIALS.index("</s>"), SPECIALS.index("<|end|>")
M = IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_plain_sft_masks_the_prompt_and_appends_eos(tok):
    ex = sft_example(tok, prompt="1+2=", response="3", max_len=16, max_prompt_len=8)
    assert ex["input_ids"] == [BOS] + char_ids("1+2=") + char_ids("3") + [EOS]
    assert ex["labels"] == [M] * 5 + char_ids("3") + [EOS]
    assert ex["prompt_len"] == 5


def test_long_prompt_keeps_its_last_tokens(tok):
    ex = sft_example(tok, prompt="abcdefgh", response="xy", max_len=10, max_prompt_len=4)
    assert ex["input_ids"] == char_ids("efgh") + char_ids("xy") + [EOS]  # BOS went with the cut
    assert ex["prompt_len"] == 4


def test_long_response_is_cut_at_max_len_and_loses_eos(tok):
    ex = sft_example(tok, prompt="ab", response="0123456789", max_len=8, max_prompt_len=4)
    assert ex["input_ids"] == [BOS] + char_ids("ab") + char_ids("01234")
    assert ex["labels"] == [M] * 3 + char_ids("01234")
    assert EOS not in ex["input_ids"]


def test_response_that_fits_exactly_keeps_eos(tok):
    ex = sft_example(tok, prompt="ab", response="0123", max_len=8, max_prompt_len=4)
    assert len(ex["input_ids"]) == 8 and ex["input_ids"][-1] == EOS


def test_cut_prompt_leaves_the_room_to_the_response(tok):
    # The prompt is cut to 3 tokens, so 5 remain for the response out of max_len 8.
    ex = sft_example(tok, prompt="pppppppp", response="0123456789", max_len=8, max_prompt_len=3)
    assert ex["input_ids"] == char_ids("ppp") + char_ids("01234") and ex["prompt_len"] == 3


def test_limits_must_leave_room_for_a_response(tok):
    with pytest.raises(ValueError, match="max_prompt_len"):
        sft_example(tok, prompt="a", response="b", max_len=4, max_prompt_len=4)


def test_chat_sft_single_turn_trains_on_the_assistant_turn_only(tok):
    ex = sft_example(tok, prompt="1+1", response="2", max_len=64, max_prompt_len=32, chat_template=True)
    head = tok("<s><|user|>1+1<|end|>\n<|assistant|>", add_special_tokens=False)["input_ids"]
    turn = char_ids("2") + [END] + char_ids("\n")
    assert ex["input_ids"] == head + turn
    assert ex["labels"] == [M] * len(head) + turn
    assert ex["prompt_len"] == len(head)


def test_chat_sft_multi_turn_trains_on_every_assistant_turn(tok):
    ex = sft_example(tok, messages=CHAT, max_len=128, max_prompt_len=64, chat_template=True)
    trained = [i for i, label in enumerate(ex["labels"]) if label != M]
    text = tok.decode([ex["input_ids"][i] for i in trained], skip_special_tokens=False)
    assert text == "2<|end|>\n5!<|end|>\n"
    assert all(ex["labels"][i] == ex["input_ids"][i] for i in trained)
    # Everything before the first assistant turn is the prompt.
    assert tok.decode(ex["input_ids"][:ex["prompt_len"]]).endswith("<|user|>1+1<|end|>\n<|assistant|>")


def test_chat_sft_multi_turn_is_cut_at_max_len(tok):
    full = sft_example(tok, messages=CHAT, max_len=128, max_prompt_len=64, chat_template=True)
    max_len = full["prompt_len"] + 6  # room for "2<|end|>\n" (3 tokens) and 3 tokens of the next user turn
    cut = sft_example(tok, messages=CHAT, max_len=max_len, max_prompt_len=full["prompt_len"], chat_template=True)
    assert cut["input_ids"] == full["input_ids"][:max_len]
    assert cut["labels"] == full["labels"][:max_len]
    assert sum(label != M for label in cut["labels"]) == 3


def test_messages_need_the_chat_template(tok):
    with pytest.raises(TemplateError, match="row 2: .*apply_chat_template"):
        sft_example(tok, messages=CHAT, max_len=64, max_prompt_len=32, where="row 2")


def test_preference_example_shares_the_prompt(tok):
    ex = preference_example(tok, prompt="2+2=", chosen="4", rejected="22", max_len=16, max_prompt_len=8)
    head = [BOS] + char_ids("2+2=")
    assert ex["chosen_input_ids"] == head + char_ids("4") + [EOS]
    assert ex["rejected_input_ids"] == head + char_ids("22") + [EOS]
    assert ex["chosen_labels"] == [M] * 5 + char_ids("4") + [EOS]
    assert ex["rejected_labels"] == [M] * 5 + char_ids("22") + [EOS]
    assert ex["prompt_len"] == 5


def test_kto_example_carries_the_label(tok):
    ex = kto_example(tok, prompt="q", response="a", label=0, max_len=8, max_prompt_len=4)
    assert ex["label"] is False and ex["labels"] == [M, M] + char_ids("a") + [EOS]
    with pytest.raises(ValueError, match="row 9: a KTO label"):
        kto_example(tok, prompt="q", response="a", label="yes", max_len=8, max_prompt_len=4, where="row 9")


def test_prompt_example_is_left_truncated(tok):
    assert prompt_example(tok, prompt="abc", max_prompt_len=8)["input_ids"] == [BOS] + char_ids("abc")
    ex = prompt_example(tok, prompt="abcdef", max_prompt_len=3)
    assert ex == {"input_ids": char_ids("def"), "prompt_len": 3}


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_ids_for_generation_match_the_training_prompt(tok, chat):
    prompt = prompt_example(tok, prompt="7+8", max_prompt_len=32, chat_template=chat)
    train = sft_example(tok, prompt="7+8", response="15", max_len=64, max_prompt_len=32, chat_template=chat)
    assert train["input_ids"][:train["prompt_len"]] == prompt["input_ids"]


ROWS = [("1+2=", "3"), ("", "0"), ("99+1=", ""), ("a long prompt that is cut", "and a long answer cut too")]


def test_many_texts_per_tokenizer_call_give_the_ids_of_one_call_each(tok, monkeypatch):
    monkeypatch.setattr(templates, "ENCODE_BATCH_TEXTS", 3)  # the rows span two calls
    texts = [text for row in ROWS for text in row] + ["<s>x</s>"]
    for specials in (True, False):
        assert encode_many(tok, texts, add_special_tokens=specials) == [
            encode(tok, text, add_special_tokens=specials) for text in texts]
    assert encode_many(tok, [], add_special_tokens=True) == []
    assert templates._plain_backend(tok) is not None  # the direct calls were the ones compared


@pytest.mark.parametrize("state", ["truncation", "padding", "special tokens split"])
def test_many_texts_ignore_length_rules_left_on_the_tokenizers_object(state):
    """A fast tokenizer's `tokenizers` object may carry truncation, padding or special-token splitting (from its
    file, or from an earlier call that asked for them); a transformers call without them gives whole texts with
    special tokens whole, and so does encode_many."""
    tok = tiny_tokenizer()
    texts = ["<s>1+2=3", "a long prompt that is cut"]
    expected = [encode(tiny_tokenizer(), text, add_special_tokens=True) for text in texts]
    backend = tok.backend_tokenizer
    if state == "truncation":
        backend.enable_truncation(max_length=3)
    elif state == "padding":
        backend.enable_padding(pad_id=0, pad_token="<pad>", length=40)
    else:
        backend.encode_special_tokens = True
    assert templates._plain_backend(tok) is None
    assert encode_many(tok, texts, add_special_tokens=True) == expected


@pytest.mark.parametrize("chat", [False, True])
def test_examples_of_many_rows_are_those_of_one_row_at_a_time(tok, chat, monkeypatch):
    """The loaders build every mode's examples many rows at a time (the texts tokenised in few calls): each row
    comes out as it would alone, truncation included."""
    monkeypatch.setattr(templates, "ENCODE_BATCH_TEXTS", 3)
    prompts, responses = [p for p, _ in ROWS], [r for _, r in ROWS]
    limits = dict(max_len=20, max_prompt_len=8, chat_template=chat)
    assert sft_examples(tok, prompts, responses, **limits) == [
        sft_example(tok, prompt=p, response=r, **limits) for p, r in ROWS]
    rejected = responses[::-1]
    assert preference_examples(tok, prompts, responses, rejected, **limits) == [
        preference_example(tok, prompt=p, chosen=c, rejected=r, **limits)
        for p, c, r in zip(prompts, responses, rejected)]
    labels = [True, 0, 1, False]
    assert kto_examples(tok, prompts, responses, labels, **limits) == [
        kto_example(tok, prompt=p, response=r, label=label, **limits) for (p, r), label in zip(ROWS, labels)]
    assert prompt_examples(tok, prompts, max_prompt_len=8, chat_template=chat) == [
        prompt_example(tok, prompt=p, max_prompt_len=8, chat_template=chat) for p in prompts]


def test_a_bad_row_among_many_is_named(tok):
    with pytest.raises(TemplateError, match="f.jsonl, line 2: a list of messages needs the chat template"):
        sft_examples(tok, ["1+1=", CHAT], ["2", "x"], max_len=16, max_prompt_len=8,
                     wheres=["f.jsonl, line 1", "f.jsonl, line 2"])
    with pytest.raises(ValueError, match="line 2: a KTO label must be true/false"):
        kto_examples(tok, ["q", "q"], ["a", "b"], [1, 2], max_len=8, max_prompt_len=4, wheres=["line 1", "line 2"])


def test_with_a_report_bad_labels_are_counted_and_left_out(tok):
    from hpc_rlhf.data.examples import process_reward_examples, single_token_id
    from hpc_rlhf.data.loading import BAD_LABEL, BadRowReport

    report = BadRowReport(where="data.train_files", rows_read=3, rows_kept=3)
    kept = kto_examples(tok, ["q", "r", "s"], ["a", "b", "c"], [1, 2, False], max_len=8, max_prompt_len=4,
                        wheres=["line 1", "line 2", "line 3"], skipped=report)
    assert kept == kto_examples(tok, ["q", "s"], ["a", "c"], [1, False], max_len=8, max_prompt_len=4)
    assert (report.counts, report.rows_kept) == ({BAD_LABEL: 1}, 2)
    assert report.first_message[BAD_LABEL] == "line 2: a KTO label must be true/false (or 1/0), got 2"

    marker = single_token_id(tok, "#", "prm.placeholder_token")
    texts = ["1+2=3#4#", "1+2=3#4#", "1+2=3#4#", "9#"]
    labels = [["+", "-"], ["+"], ["+", "ok"], [0.5]]
    report = BadRowReport(where="data.train_files", rows_read=4, rows_kept=4)
    kept = process_reward_examples(tok, texts, labels, marker_id=marker, reward_tokens=["+", "-"], max_len=32,
                                   wheres=[f"f, line {n}" for n in range(1, 5)], skipped=report)
    assert kept == process_reward_examples(tok, texts[::3], labels[::3], marker_id=marker, reward_tokens=["+", "-"],
                                           max_len=32)
    assert (report.counts, report.rows_kept, report.skipped) == ({BAD_LABEL: 2}, 2, 2)
    assert report.first_message[BAD_LABEL] == ("f, line 2: 1 labels for 2 step markers: a process reward row needs "
                                              "one label per marker")


def test_pad_collate_right_pads_ids_mask_and_labels():
    batch = [{"input_ids": [5, 6, 7], "labels": [M, 6, 7], "prompt_len": 1, "label": True},
             {"input_ids": [8], "labels": [8], "prompt_len": 0, "label": False}]
    out = pad_collate(batch, pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[M, 6, 7], [8, M, M]]
    assert out["prompt_lens"].tolist() == [1, 0]
    assert out["label"].tolist() == [True, False]
    assert out["input_ids"].dtype == torch.long


def test_pad_collate_left_lines_up_the_last_tokens():
    out = pad_collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}], pad_id=0, side="left")
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert "labels" not in out


def test_shared_prompt_pair_collate_holds_the_prompt_once_and_hides_chosen_from_rejected():
    pairs = [{"chosen_input_ids": [1, 5, 6, 7, 2], "rejected_input_ids": [1, 5, 6, 8, 9, 2], "prompt_len": 3},
             {"chosen_input_ids": [1, 4, 2], "rejected_input_ids": [1, 3, 2], "prompt_len": 1}]
    out = shared_prompt_pair_collate(pairs, pad_id=0)
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 2, 8, 9, 2], [1, 4, 2, 3, 2, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 1, 2, 0, 0, 0]]
    assert out["chosen_last"].tolist() == [4, 2] and out["rejected_last"].tolist() == [7, 4]
    assert out["tokens"] == 13
    mask = out["attention_mask"]
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    seen = [[[int(k) for k in range(8) if mask[b, 0, q, k]] for q in range(8)] for b in range(2)]
    assert seen[0] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4],  # the prompt, then chosen
                       [0, 1, 2, 5], [0, 1, 2, 5, 6], [0, 1, 2, 5, 6, 7]]  # rejected: the prompt and itself
    assert seen[1] == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4], [5], [6], [7]]  # padding: itself only
    with pytest.raises(ValueError, match="different prompts"):
        shared_prompt_pair_collate([{"chosen_input_ids": [1, 5, 2], "rejected_input_ids": [1, 6, 2],
                                     "prompt_len": 2}], pad_id=0)


def test_pair_collate_puts_chosen_rows_first_then_rejected():
    pairs = [{"chosen_input_ids": [1, 2], "chosen_labels": [M, 2], "rejected_input_ids": [1, 3, 3],
              "rejected_labels": [M, 3, 3], "prompt_len": 1},
             {"chosen_input_ids": [4, 5], "chosen_labels": [M, 5], "rejected_input_ids": [4, 6],
              "rejected_labels": [M, 6], "prompt_len": 1}]
    out = pair_collate(pairs, pad_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 0], [4, 5, 0], [1, 3, 3], [4, 6, 0]]
    assert out["labels"].tolist() == [[M, 2, M], [M, 5, M], [M, 3, 3], [M, 6, M]]
    assert out["prompt_lens"].tolist() == [1, 1, 1, 1]


def test_process_reward_examples_place_markers_and_targets_and_cut_at_max_len(tok):
    from hpc_rlhf.data.examples import process_reward_examples, single_token_id

    marker = single_token_id(tok, "#", "prm.placeholder_token")
    texts = ["1+2=3#4#", "9+9=18#x#"]
    examples = process_reward_examples(tok, texts, [["+", "-"], [0.75, 0.0]], marker_id=marker,
                                       reward_tokens=["+", "-"], max_len=32, wheres=["f, line 1", "f, line 2"])
    ids = tok(texts[0])["input_ids"]
    assert examples[0]["input_ids"] == ids and ids[examples[0]["marker_positions"][0]] == marker
    assert examples[0]["marker_positions"] == [i for i, t in enumerate(ids) if t == marker]
    assert examples[0]["marker_targets"] == [[1.0, 0.0], [0.0, 1.0]]
    assert examples[1]["marker_targets"] == [[0.75, 0.25], [0.0, 1.0]]  # soft: the first token's probability
    # Cut after the first marker: the second marker goes with its label.
    cut = process_reward_examples(tok, texts[:1], [["+", "-"]], marker_id=marker, reward_tokens=["+", "-"],
                                  max_len=examples[0]["marker_positions"][0] + 1)[0]
    assert cut["marker_positions"] == examples[0]["marker_positions"][:1] and cut["marker_targets"] == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="f, line 1: no step marker within the first 3 tokens"):
        process_reward_examples(tok, texts[:1], [["+", "-"]], marker_id=marker, reward_tokens=["+", "-"], max_len=3,
                                wheres=["f, line 1"])
    with pytest.raises(ValueError, match="f, line 1: a numeric step label \\(0.5\\) needs exactly two reward tokens"):
        process_reward_examples(tok, texts[:1], [[0.5, "+"]], marker_id=marker, reward_tokens=["+", "-", "?"],
                                max_len=32, wheres=["f, line 1"])
    with pytest.raises(ValueError, match="f, line 1: a step label must be one of .* or a number in \\[0, 1\\], got 2"):
        process_reward_examples(tok, texts[:1], [[2, "+"]], marker_id=marker, reward_tokens=["+", "-"], max_len=32,
                                wheres=["f, line 1"])
    with pytest.raises(ValueError, match="prm.reward_tokens='ab' is 2 tokens"):
        single_token_id(tok, "ab", "prm.reward_tokens")
