"""Prompts and observations as token ids, plain and through a chat template: an episode in chat form is, token
for token, the template's rendering of the conversation it stands for."""

import pytest

from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.envs.base import EnvError
from hpc_rlhf.envs.episodes import run_episodes
from hpc_rlhf.envs.transcript import Transcript
from tests.envs.conftest import Scripted, factory, settings

# The tiny template with a `tool` role (written with the system marker and a label), and a variant whose
# assistant turns end with <eos> and a line break, like ChatML's <|im_end|>\n.
ROLE = ("{%- if message['role'] == 'tool' -%}{{- '<|system|>tool: ' -}}"
        "{%- else -%}{{- '<|' + message['role'] + '|>' -}}{%- endif -%}")
WITH_TOOL = ("{{- bos_token -}}{%- for message in messages -%}" + ROLE + "{{- message['content'] + eos_token -}}"
             "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}")
LINE_AFTER_TURN = WITH_TOOL.replace("{{- message['content'] + eos_token -}}",
                                    "{{- message['content'] + eos_token + '\\n' -}}")


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture()
def chat_tokenizer(tokenizer):
    original = tokenizer.chat_template
    yield tokenizer
    tokenizer.chat_template = original


def test_plain_prompts_and_observations_are_tokenised_on_their_own(tokenizer):
    transcript = Transcript(tokenizer, chat=False)
    assert transcript.prompt_ids("17+25=", 16) == [tokenizer.bos_token_id] + ids(tokenizer, "17+25=")
    assert transcript.prompt_ids("17+25=", 3) == ids(tokenizer, "25=")
    assert transcript.first_observation("") == [] and transcript.first_observation("=4\n") == ids(tokenizer, "=4\n")
    assert transcript.next_observation("hi", tokenizer.eos_token_id) == ids(tokenizer, "hi")


@pytest.mark.parametrize("template", [WITH_TOOL, LINE_AFTER_TURN])
def test_a_chat_episode_is_the_template_rendering_of_its_conversation(chat_tokenizer, template):
    tok = chat_tokenizer
    tok.chat_template = template

    class Tool:
        def reset(self, row):
            self.turn = 0
            return "numbers only"

        def step(self, action):
            self.turn += 1
            return f"={self.turn}", 0.0, self.turn == 3

    # turn 1 ends with the <eos> the model sampled; turn 2 is cut at the stop string, so the template's end of an
    # assistant turn is added as context; turn 3 ends the episode.
    turns = ["12<eos>", "<calc>1+1</calc>ignored", "7<eos>"]
    transcript = Transcript(tok, chat=True)
    prompt = transcript.prompt_ids("17+25=", 32)
    batch = run_episodes([{"prompt": "17+25="}], [prompt], Scripted(tok, turns), SamplingParams(max_new_tokens=30),
                         env=factory(Tool, stop=["</calc>"]), tokenizer=tok,
                         settings=settings(max_turns=3, max_episode_tokens=200), chat=True)
    episode = batch.episodes[0]
    conversation = [{"role": "user", "content": "17+25="}, {"role": "tool", "content": "numbers only"},
                    {"role": "assistant", "content": "12"}, {"role": "tool", "content": "=1"},
                    {"role": "assistant", "content": "<calc>1+1</calc>"}, {"role": "tool", "content": "=2"},
                    {"role": "assistant", "content": "7"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    trailing = "\n" if template == LINE_AFTER_TURN else ""  # after the last turn's <eos>: not the model's, not added
    assert tok.decode(prompt + episode.tokens.tolist(), skip_special_tokens=False) + trailing == rendered
    assert prompt + episode.tokens.tolist() + ids(tok, trailing) == ids(tok, rendered)
    model_text = [tok.decode(episode.tokens[s:e].tolist(), skip_special_tokens=False) for s, e in episode.turn_spans]
    assert model_text == ["12<eos>", "<calc>1+1</calc>", "7<eos>"]
    assert int(episode.mask.sum()) == sum(e - s for s, e in episode.turn_spans)


def test_an_empty_first_observation_adds_only_the_generation_prompt(chat_tokenizer):
    chat_tokenizer.chat_template = WITH_TOOL
    transcript = Transcript(chat_tokenizer, chat=True)
    assert transcript.first_observation("") == [chat_tokenizer.convert_tokens_to_ids("<|assistant|>")]
    assert transcript.prompt_ids("1+1=", 32) == ids(chat_tokenizer, "<bos><|user|>1+1=<eos>")


def test_a_role_the_template_refuses_is_named_before_any_episode(tokenizer):
    # The shipped tiny template knows system, user and assistant only.
    with pytest.raises(EnvError, match=r"env.observation_role='tool': .*chat role must be system, user or "
                                       r"assistant.*set env.observation_role to a role the chat template renders"):
        Transcript(tokenizer, chat=True)
    transcript = Transcript(tokenizer, chat=True, observation_role="user")
    assert transcript.next_observation("=4", tokenizer.eos_token_id) == ids(tokenizer, "<|user|>=4<eos><|assistant|>")
    assert transcript.next_observation("=4", None) == ids(tokenizer, "<eos><|user|>=4<eos><|assistant|>")


def test_a_template_that_rewrites_earlier_messages_is_refused(chat_tokenizer):
    # hides the content of assistant messages once a tool message follows (as templates that drop the reasoning
    # of past turns do), so the conversation does not grow by appending
    chat_tokenizer.chat_template = WITH_TOOL.replace(
        "{{- message['content'] + eos_token -}}",
        "{%- if message['role'] == 'assistant' and messages[-1]['role'] == 'tool' -%}{{- '...' + eos_token -}}"
        "{%- else -%}{{- message['content'] + eos_token -}}{%- endif -%}")
    with pytest.raises(EnvError, match="rewrites earlier messages when a message of role 'tool' follows them"):
        Transcript(chat_tokenizer, chat=True)
