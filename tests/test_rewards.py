import pytest
import torch

from hpc_rlhf import rewards
from tests.reward_server import reward_server


def test_builtin_exact_match():
    assert rewards.exact_match(["1+2="], ["3<eos>"], ["3"]) == [1.0]
    assert rewards.exact_match(["1+2="], ["4<eos>"], ["3"]) == [0.0]
    assert rewards.exact_match(["x"], ["3"], [None]) == [0.0]


def test_function_from_file_and_module(tmp_path):
    f = tmp_path / "myreward.py"
    f.write_text("def length(prompts, responses, answers):\n    return [float(len(r)) for r in responses]\n")
    fn = rewards.load_reward_function(f"{f}:length")
    assert rewards.call_reward_function(fn, "x", ["a", "b"], ["xy", "z"], [None, None]) == [2.0, 1.0]
    fn = rewards.load_reward_function("hpc_rlhf.rewards:exact_match")
    assert fn is rewards.exact_match


@pytest.mark.parametrize("spec,message", [
    ("nocolon", "must look like path/to/file.py:function"),
    ("/nope/missing.py:f", "does not exist"),
    ("hpc_rlhf.no_such_module:f", "importing hpc_rlhf.no_such_module failed: ModuleNotFoundError"),
    ("hpc_rlhf.rewards:no_such_fn", "has no callable 'no_such_fn'"),
])
def test_bad_specs(spec, message):
    with pytest.raises(rewards.RewardFunctionError, match=message):
        rewards.load_reward_function(spec)


def test_broken_module_names_the_import_error(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import not_a_real_package\n")
    with pytest.raises(rewards.RewardFunctionError, match="ModuleNotFoundError"):
        rewards.load_reward_function(f"{f}:f")


@pytest.mark.parametrize("returned,message", [
    (3.0, "returned float; it must return a list of 2 floats"),
    ([1.0], "returned 1 rewards for 2 responses"),
    ([1.0, "a"], "returned 'a' \\(str\\) for response 1"),
    ([1.0, float("nan")], "returned nan for response 1"),
    ([True, 1.0], "rewards must be numbers"),
])
def test_bad_return_values(returned, message):
    with pytest.raises(rewards.RewardFunctionError, match=message):
        rewards.call_reward_function(lambda p, r, a: returned, "f", ["a", "b"], ["a", "b"], [None, None])


def test_tensor_return_and_raising_function():
    assert rewards.call_reward_function(lambda p, r, a: torch.tensor([1.0, 2.0]), "f", ["a", "b"], ["a", "b"],
                                        [None, None]) == [1.0, 2.0]
    with pytest.raises(rewards.RewardFunctionError, match="reward function 'f' raised ZeroDivisionError"):
        rewards.call_reward_function(lambda p, r, a: 1 / 0, "f", ["a"], ["a"], [None])


def test_http_endpoint_round_trip():
    with reward_server(lambda response: float(len(response))) as url:
        assert rewards.remote_rewards(url, ["p", "q"], ["ab", "c"], [None, None]) == [2.0, 1.0]
