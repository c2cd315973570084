"""Built-in environment: the tiny task with a calculator tool (layout: hpc_rlhf.data.tool_task).

The model may call the tool, `<calc>17+25</calc>` (its turn ends at `</calc>`); the environment answers `=42` and
a line break, and the model goes on. A turn without a call is the model's answer: the episode ends with reward
1.0 when it is exactly the row's `answer` (the exact-match rule of the tiny task), else 0.0. Every call counts in
info["tool_calls"]; env.max_turns bounds how many the model can make.
"""

from __future__ import annotations

from hpc_rlhf.data.synthetic import EOS_TEXT, exact_match
from hpc_rlhf.data.tool_task import CALL_CLOSE, CALL_OPEN, evaluate, result_text
from hpc_rlhf.envs.base import EnvError, Environment


class Calculator(Environment):
    stop_strings = (CALL_CLOSE,)

    def __init__(self):
        self.answer: str | None = None

    def reset(self, row: dict) -> str:
        if row.get("answer") is None:
            raise EnvError("the calculator needs the row's reference 'answer'")
        self.answer = str(row["answer"])
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        text = action.strip()
        while text.endswith(EOS_TEXT):
            text = text.removesuffix(EOS_TEXT).rstrip()
        if text.endswith(CALL_CLOSE) and CALL_OPEN in text:
            expression = text[text.rindex(CALL_OPEN) + len(CALL_OPEN):-len(CALL_CLOSE)]
            return result_text(evaluate(expression)), 0.0, False, {"tool_calls": 1}
        return "", exact_match(action, self.answer), True, {"tool_calls": 0}
