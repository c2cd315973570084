import pytest
import torch

from hpc_rlhf import rewards
from tests.reward_server import raw_reward_server, reward_server


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


@pytest.mark.parametrize("returned,message", [
    ([1e39], r"returned 1e\+39 for response 0, past float32's range"),
    ([10 ** 400], r"returned 1000000000.* for response 0; rewards must be finite"),
])
def test_rewards_must_fit_float32(returned, message):
    with pytest.raises(rewards.RewardFunctionError, match="reward function 'f' " + message):
        rewards.call_reward_function(lambda p, r, a: returned, "f", ["a"], ["a"], [None])


def test_a_weight_that_overflows_float32_names_the_source():
    total = 1e3 * torch.tensor([1.0, 1e36])
    with pytest.raises(rewards.RewardFunctionError, match=r"^reward function 'f' gave response 1 the reward inf after "
                                                          r"weighting"):
        rewards.check_weighted(total, "reward function 'f'")


@pytest.mark.parametrize("raw,message", [
    (b'{"rewards": [1e39]}', "returned 1e+39 for response 0, past float32's range"),
    (b'{"rewards": [' + b"9" * 400 + b']}', "for response 0; rewards must be finite"),
    (b'{"rewards": [' + b"9" * 5000 + b']}', "answered something that is not JSON"),
    (b"[" * 50_000 + b"]" * 50_000, "answered JSON nested too deeply to read"),
    (b"\xff\xfe", "answered bytes that are not UTF-8 text"),
    (b'{"rewards": [' + b"0.5, " * 40_000 + b"]}", "more than the cap of 0.1 MB (reward.http_max_reply_mb)"),
])
def test_unusable_remote_replies_name_the_endpoint(raw, message):
    with raw_reward_server(raw) as url:
        with pytest.raises(rewards.RewardFunctionError) as caught:
            rewards.remote_rewards(url, ["p"], ["r"], [None], timeout_s=5, max_reply_mb=0.1)
    assert str(caught.value).startswith(f"reward endpoint {url} ") and message in str(caught.value), str(caught.value)


def test_a_slow_remote_reward_ends_at_its_deadline_naming_the_url_and_the_key():
    with raw_reward_server(b'{"rewards": [1.0]}', delay_s=2.0) as url:
        with pytest.raises(rewards.RewardFunctionError, match=rf"^reward endpoint {url} failed 1 time; last: no "
                                                              rf"complete answer within 0.2 s "
                                                              rf"\(reward.http_timeout_s, a deadline per try\)"):
            rewards.remote_rewards(url, ["p"], ["r"], [None], timeout_s=0.2, retries=1)


def test_remote_urls_with_credentials_are_refused_without_showing_them():
    with pytest.raises(rewards.RewardFunctionError) as caught:
        rewards.remote_rewards("http://me:hunter2@127.0.0.1:1/score", ["p"], ["r"], [None])
    assert "reward.http_url holds a user name or password" in str(caught.value)
    assert "hunter2" not in str(caught.value)
    with pytest.raises(rewards.RewardFunctionError) as caught:
        rewards.remote_rewards("http://127.0.0.1:1/score?token=hunter2", ["p"], ["r"], [None])
    assert "reward.http_url holds a credential in the query parameter 'token'" in str(caught.value)
    assert "reward.http_headers_from_env" in str(caught.value) and "hunter2" not in str(caught.value)


def test_a_busy_endpoint_is_tried_again_with_the_same_request_id(monkeypatch):
    monkeypatch.setattr(rewards, "backoff_s", lambda attempt: 0.01)
    bodies = []
    with raw_reward_server(b'{"rewards": [0.5]}', busy_first=2, bodies=bodies) as url:
        assert rewards.remote_rewards(url, ["p"], ["r"], [None]) == [0.5]
        assert rewards.remote_rewards(url, ["p"], ["r"], [None]) == [0.5]
    ids = [body["request_id"] for body in bodies]
    assert len(ids) == 4 and ids[0] == ids[1] == ids[2] != ids[3]  # a call's tries share one id; a new call not


def test_the_longest_remote_call_counts_every_try_and_pause():
    assert rewards.longest_remote_call_s(10.0) == 3 * 10.0 + 1.0 + 2.0
