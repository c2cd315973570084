"""The built-in guessing game: the observation after a guess depends on the guess."""

import pytest

from hpc_rlhf.envs.base import EnvError
from hpc_rlhf.envs.guess_number import GuessNumber


def test_feedback_follows_the_guess_and_late_right_guesses_earn_less():
    env = GuessNumber()
    assert env.reset({"prompt": "17+25=", "answer": "42"}) == ""
    assert env.step("32<eos>") == ("higher\n17+25=", 0.0, False)
    assert env.step("52<eos>") == ("lower\n17+25=", 0.0, False)
    assert env.step("x<eos>") == ("not a number\n17+25=", 0.0, False)
    assert env.step("42<eos>") == ("", 0.125, True)
    env = GuessNumber()
    env.reset({"prompt": "1+1=", "answer": 2})
    assert env.step("2<eos>") == ("", 1.0, True)


def test_a_row_without_an_integer_answer_is_refused():
    with pytest.raises(EnvError, match="integer 'answer'"):
        GuessNumber().reset({"prompt": "1+1="})
