import pytest

from hpc_rlhf.data.loading import DataError
from hpc_rlhf.data.templates import (Segment, TemplateError, as_messages, chat_segments, prompt_text, render_chat,
                                     tokenize_chat)
from tests.data.conftest import CHAT, SPECIALS, char_ids, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_tiny_tokenizer_is_character_level(tok):
    assert tok("ab", add_special_tokens=False)["input_ids"] == char_ids("ab")
    assert tok("ab")["input_ids"] == [tok.bos_token_id] + char_ids("ab")
    assert tok("<|end|>", add_special_tokens=False)["input_ids"] == [SPECIALS.index("<|end|>")]


def test_as_messages_turns_a_prompt_into_a_user_turn():
    assert as_messages("hi", "yo") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    history = [{"role": "user", "content": "a"}]
    assert as_messages(history) == history and as_messages(history) is not history


def test_prompt_text_plain_is_the_prompt_and_chat_ends_at_the_assistant_turn(tok):
    assert prompt_text(tok, "3+4=", chat_template=False) == "3+4="
    assert prompt_text(tok, "3+4=", chat_template=True) == "<s><|user|>3+4=<|end|>\n<|assistant|>"


def test_plain_prompt_refuses_a_message_list(tok):
    with pytest.raises(TemplateError, match=r"data.jsonl, line 4: .*apply_chat_template=true"):
        prompt_text(tok, CHAT[:2], chat_template=False, where="data.jsonl, line 4")


def test_chat_segments_join_to_the_render_and_mark_only_assistant_turns(tok):
    segments = chat_segments(tok, CHAT)
    assert "".join(s.text for s in segments) == render_chat(tok, CHAT)
    assert [s for s in segments if s.trainable] == [Segment("2<|end|>\n", True), Segment("5!<|end|>\n", True)]
    assert segments[0] == Segment("<s><|system|>be brief<|end|>\n<|user|>1+1<|end|>\n<|assistant|>", False)


def test_tokenize_chat_gives_the_token_ranges_of_every_assistant_turn(tok):
    ids, ranges = tokenize_chat(tok, CHAT)
    assert ids == tok(render_chat(tok, CHAT), add_special_tokens=False)["input_ids"]
    end = SPECIALS.index("<|end|>")
    assert [ids[a:b] for a, b in ranges] == [char_ids("2") + [end] + char_ids("\n"),
                                             char_ids("5!") + [end] + char_ids("\n")]
    assert ranges[-1][1] == len(ids)  # the conversation ends with the last assistant turn


def test_tokenize_chat_needs_an_assistant_turn(tok):
    with pytest.raises(TemplateError, match="row 3: .*no assistant turn"):
        tokenize_chat(tok, CHAT[:2], where="row 3")


def test_missing_chat_template_names_the_tokenizer_folder_and_row(tmp_path):
    tok = tiny_tokenizer(chat_template=None, folder=tmp_path / "tok")
    with pytest.raises(TemplateError) as err:
        prompt_text(tok, "hi", chat_template=True, where="train.jsonl, line 7")
    message = str(err.value)
    assert "train.jsonl, line 7" in message and str(tmp_path / "tok") in message and "no chat template" in message
    assert isinstance(err.value, DataError)


def test_bad_role_names_the_tokenizer_folder_row_and_template_message(tmp_path):
    tok = tiny_tokenizer(folder=tmp_path / "tok")
    with pytest.raises(TemplateError) as err:
        tokenize_chat(tok, [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}],
                      where="chats.parquet, row 12")
    message = str(err.value)
    for part in ("chats.parquet, row 12", str(tmp_path / "tok"), "unknown role robot", "'robot'"):
        assert part in message


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    # Renders the final assistant turn differently from an earlier one, so prefixes are not prefixes.
    tok = tiny_tokenizer(chat_template="{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]"
                                       "{% else %}{{ m['content'] }};{% endif %}{% endfor %}")
    with pytest.raises(TemplateError, match="growing sequence of turns"):
        chat_segments(tok, CHAT, where="row 1")
