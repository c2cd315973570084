"""What the environment tests share: the tiny tokenizer, a tiny random Llama from hpc_rlhf.models.tiny served by
the hf rollout engine, a generate that records every call, and small scripted environments."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.loading import EnvFactory
from hpc_rlhf.models import tiny

# The random model's next-token distribution is close to uniform over 104 tokens, so a stop string of two
# characters would almost never be sampled. An output bias makes these tokens likely (about 90% of the samples
# together), so stop strings made of them occur in every test; the rest of the model is left as built.
FAVOURED = {"a": 4.0, "b": 4.0, "c": 4.0, "<|user|>": 4.0, "<eos>": 1.5}


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.load_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny.model_config("llama-tiny"), dtype=torch.float32)
    bias = torch.zeros(model.config.vocab_size)
    for token, value in FAVOURED.items():
        bias[tokenizer.convert_tokens_to_ids(token)] = value
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model.eval()


@pytest.fixture(scope="session")
def engine(model, tokenizer):
    return HFRolloutEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)


class Recorder:
    """engine.generate, counting its calls and keeping what each was asked and what it sampled."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[dict] = []

    def __call__(self, prompts, sampling):
        batch = self.engine.generate(prompts, sampling)
        self.calls.append({"prompts": [list(p) for p in prompts], "sampling": sampling,
                           "tokens": [t.tolist() for t in batch.flat_responses()],
                           "logprobs": [lp.clone() for lp in batch.flat_logprobs()]})
        return batch


class Scripted:
    """A generate that answers every context with the next of `turns` (a text, or token ids as they are), log-prob
    -1 per token: for tests of layouts that a random model would not produce."""

    def __init__(self, tokenizer, turns: list[str | list[int]]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0

    def __call__(self, prompts, sampling):
        turn = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer(turn, add_special_tokens=False)["input_ids"] if isinstance(turn, str) else turn
        ids = ids[:sampling.max_new_tokens]
        return [torch.tensor(ids)] * len(prompts), [torch.full((len(ids),), -1.0)] * len(prompts)


def factory(cls, name: str = "test-env", stop=(), timeout_s: float = 5.0) -> EnvFactory:
    return EnvFactory(name=name, make=cls, stop_strings=tuple(stop), call_timeout_s=timeout_s)


def settings(**overrides) -> EnvSection:
    values = dict(name="test-env", max_turns=3, max_episode_tokens=48)
    values.update(overrides)
    return EnvSection(**values)


class Echo:
    """Never done; answers each action with `[its length]` and rewards 0.25 per turn."""

    def reset(self, row):
        return f"<{row['prompt']}>"

    def step(self, action):
        return observation_for(action), 0.25, False, {"tool_calls": 1}


def observation_for(action: str) -> str:
    return f"[{len(action)}]"
