"""The calculator tool's text layout and the tool-use SFT demonstrations."""

import pytest

from hpc_rlhf.data import synthetic, tool_task


@pytest.mark.parametrize("text, value", [("17+25", 42), ("2+3*4-1", 13), ("3*4*2", 24), ("10-2-3", 5),
                                         (" 7 + 8 ", 15), ("0", 0), ("", None), ("1+", None), ("a+1", None),
                                         ("1/2", None), ("-3+1", None), ("1" * 13, None)])
def test_evaluate_knows_integers_joined_by_plus_minus_times(text, value):
    assert tool_task.evaluate(text) == value


def test_a_tool_demonstration_calls_the_tool_and_copies_its_result():
    assert tool_task.tool_response(synthetic.Problem(17, 25)) == "<calc>17+25</calc>=42\n42"
    assert tool_task.result_text(None) == "=?\n"


def test_a_minority_of_demonstrations_use_the_tool_the_rest_are_the_plain_ones():
    problems = synthetic.split_problems(0).train
    rows = tool_task.tool_sft_rows(problems, seed=0)
    plain = synthetic.sft_rows(problems, seed=0)
    with_tool = [i for i, row in enumerate(rows) if row["response"].startswith(tool_task.CALL_OPEN)]
    assert len(with_tool) == round(tool_task.DEFAULT_TOOL_SHARE * len(problems))
    assert all(rows[i]["response"] == tool_task.tool_response(problems[i]) for i in with_tool)
    assert all(row == plain[i] for i, row in enumerate(rows) if i not in set(with_tool))
    assert rows == tool_task.tool_sft_rows(problems, seed=0) != tool_task.tool_sft_rows(problems, seed=1)
    with pytest.raises(ValueError, match="tool_share"):
        tool_task.tool_sft_rows(problems, tool_share=1.5)
