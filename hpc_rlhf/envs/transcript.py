"""How an episode's prompt and the environment's observations become token ids (the model's tokens never pass
through here: they stay as sampled).

Plain data (data.apply_chat_template=false): the prompt is tokenised as for single-turn RL, and each observation
is its text tokenised once, on its own, and appended.

Chat data: the prompt is the chat rendered WITHOUT the generation prompt; the tokens that follow it come from the
template. Before the model's first turn: the first observation as a message of role `env.observation_role` (when
it is not empty) and the generation prompt. After each model turn: the template's end of an assistant turn (less
the stop token the model already sampled, e.g. its `<eos>`), the observation's message and the generation prompt.
These pieces are found by rendering a placeholder conversation with and without the observation and taking the
difference, so any template that renders a conversation as a growing sequence of messages works; one that does
not is refused with a clear error.
"""

from __future__ import annotations

import functools
from typing import Sequence

from hpc_rlhf.data.examples import prompt_example
from hpc_rlhf.data.templates import TemplateError, as_messages, encode, render_chat, tokenizer_name
from hpc_rlhf.envs.base import EnvError

# Placeholder contents of the conversation the template pieces are cut from.
_USER = {"role": "user", "content": "hpc_rlhf placeholder question"}
_TURN_MARK = "hpc_rlhf placeholder answer"


class Transcript:
    def __init__(self, tokenizer, *, chat: bool, observation_role: str = "tool"):
        self.tokenizer = tokenizer
        self.chat = chat
        self.role = observation_role
        if chat:
            self._after_prompt = render_chat(tokenizer, [_USER])
            self._after_turn = render_chat(tokenizer, [_USER, {"role": "assistant", "content": _TURN_MARK}])
            if self._after_turn.count(_TURN_MARK) != 1 or not self._after_turn.startswith(self._after_prompt):
                raise EnvError(f"the chat template of tokenizer '{tokenizer_name(tokenizer)}' does not render an "
                               f"assistant message as a message appended to the conversation; episodes cannot be "
                               f"built with it (use plain data: data.apply_chat_template=false)")
            self._end_of_turn = self._after_turn[self._after_turn.index(_TURN_MARK) + len(_TURN_MARK):]
            self.first_observation("probe")  # a role the template refuses fails here, before any episode runs
            self.next_observation("probe", None)

    def prompt_ids(self, prompt: str | Sequence[dict], max_prompt_len: int) -> list[int]:
        """The prompt's token ids (its last `max_prompt_len`): as single-turn RL tokenises it for plain data, the
        chat without a generation prompt for chat data."""
        if not self.chat:
            return prompt_example(self.tokenizer, prompt=prompt, max_prompt_len=max_prompt_len)["input_ids"]
        text = render_chat(self.tokenizer, as_messages(prompt))
        return encode(self.tokenizer, text, add_special_tokens=False)[-max_prompt_len:]

    def first_observation(self, observation: str) -> list[int]:
        """Tokens between the prompt and the model's first turn."""
        if not self.chat:
            return self._encode(observation)
        return self._encode(self._delta(self._after_prompt, [_USER], observation))

    def next_observation(self, observation: str, last_model_token: int | None) -> list[int]:
        """Tokens between a model turn that ended with `last_model_token` and the model's next turn."""
        if not self.chat:
            return self._encode(observation)
        end = self._end_of_turn
        if last_model_token is not None:
            sampled_end = self.tokenizer.decode([last_model_token], skip_special_tokens=False)
            if sampled_end and end.startswith(sampled_end):  # the model already closed its turn itself
                end = end[len(sampled_end):]
        turn = [_USER, {"role": "assistant", "content": _TURN_MARK}]
        return self._encode(end + self._delta(self._after_turn, turn, observation))

    @functools.lru_cache(maxsize=4096)  # observations repeat (e.g. "higher"); a template render costs ~0.1 ms
    def _delta_text(self, before: str, messages: tuple, observation: str) -> str:
        conversation = [dict(m) for m in messages]
        if observation:
            conversation.append({"role": self.role, "content": observation})
        try:
            full = render_chat(self.tokenizer, conversation, add_generation_prompt=True)
        except TemplateError as exc:
            raise EnvError(f"env.observation_role={self.role!r}: {exc}; set env.observation_role to a role the "
                           f"chat template renders (e.g. user)") from None
        if not full.startswith(before):
            raise EnvError(f"the chat template of tokenizer '{tokenizer_name(self.tokenizer)}' rewrites earlier "
                           f"messages when a message of role {self.role!r} follows them, so observations cannot be "
                           f"appended token for token (use plain data: data.apply_chat_template=false)")
        return full[len(before):]

    def _delta(self, before: str, messages: list[dict], observation: str) -> str:
        return self._delta_text(before, tuple(tuple(sorted(m.items())) for m in messages), observation)

    def _encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text, add_special_tokens=False) if text else []
