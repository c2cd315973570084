"""The built-in calculator environment, and that an episode with it has exactly the layout of the tool-use SFT
demonstrations (so SFT on them teaches the format the RL episodes use)."""

import torch

from hpc_rlhf.data import synthetic, tool_task
from hpc_rlhf.data.examples import sft_example
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.envs.calculator import Calculator
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.episodes import run_episodes
from hpc_rlhf.envs.loading import load_environment
from hpc_rlhf.envs.transcript import Transcript
from tests.envs.conftest import Scripted

ROW = {"prompt": "17+25=", "answer": "42"}


def test_a_call_gets_the_result_and_the_answer_ends_the_episode_with_exact_match():
    env = Calculator()
    assert env.reset(ROW) == ""
    assert env.step("<calc>17+25</calc>") == ("=42\n", 0.0, False, {"tool_calls": 1})
    assert env.step("<calc>17+</calc>") == ("=?\n", 0.0, False, {"tool_calls": 1})
    assert env.step("42<eos>") == ("", 1.0, True, {"tool_calls": 0})
    assert Calculator().reset(ROW) == "" and Calculator.step(env, "32<eos>")[1:3] == (0.0, True)
    assert env.step("42 is it<eos>")[1] == 0.0


def test_the_tiny_tokenizer_writes_the_tool_layout_one_character_per_token(tokenizer):
    text = tool_task.tool_response(synthetic.Problem(99, 98)) + tool_task.result_text(None)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text


def episode(tokenizer, turns, max_turns=3):
    section = EnvSection(name="calculator", max_turns=max_turns, max_episode_tokens=64)
    factory = load_environment(section)
    transcript = Transcript(tokenizer, chat=False)
    batch = run_episodes([ROW], [transcript.prompt_ids(ROW["prompt"], 16)], Scripted(tokenizer, turns),
                         SamplingParams(max_new_tokens=32), env=factory, tokenizer=tokenizer, settings=section)
    return batch.episodes[0]


def test_an_episode_lays_out_tokens_exactly_as_the_tool_demonstration(tokenizer):
    # The model writes past the call; the turn is cut at </calc> and what follows is dropped.
    e = episode(tokenizer, ["<calc>17+25</calc>=99\n", "42<eos>"])
    demo = sft_example(tokenizer, prompt=ROW["prompt"], response=tool_task.tool_response(synthetic.Problem(17, 25)),
                       max_len=64, max_prompt_len=16)
    assert e.prompt_ids + e.tokens.tolist() == demo["input_ids"]
    call, result, answer = "<calc>17+25</calc>", "=42\n", ["4", "2", "<eos>"]
    assert e.mask.tolist() == [True] * len(call) + [False] * len(result) + [True] * len(answer)
    assert e.turn_rewards == [0.0, 1.0] and e.reward == 1.0 and e.tool_calls == 1 and e.done
    assert torch.equal(e.logprobs, torch.where(e.mask, -1.0, 0.0))


def test_a_direct_answer_is_one_turn_and_calls_end_at_max_turns(tokenizer):
    e = episode(tokenizer, ["32<eos>"])
    assert e.turns == 1 and e.reward == 0.0 and e.tool_calls == 0 and e.done
    e = episode(tokenizer, ["<calc>1+1</calc>", "<calc>2+2</calc>"], max_turns=2)
    assert e.turns == 2 and e.tool_calls == 2 and not e.done and e.reward == 0.0
