"""The tiny task with a calculator tool: the text layout of a tool call and its result, and SFT demonstrations.

A model that uses the tool writes a call, the environment (hpc_rlhf.envs.calculator) answers with the result,
and the model then writes its answer:

    17+25=<calc>17+25</calc>=42
    42<eos>

`<calc>17+25</calc>` is the model's first turn (it ends at the stop string `</calc>`), `=42\\n` the environment's
observation, `42<eos>` the model's second turn. In plain text (no chat template) an episode is exactly that
concatenation, so a demonstration whose response is `<calc>17+25</calc>=42\\n42` teaches the layout the episode
driver (hpc_rlhf.envs.episodes) produces, token for token, with the character tokenizer.

The demonstrations mix the two ways of answering: a minority (`DEFAULT_TOOL_SHARE`) call the tool and copy its
result, the rest answer directly as in synthetic.sft_rows (with its dropped-carry mistakes). Imitation learns to
call the tool now and then; RL with the exact-match reward can learn that calling it pays.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from hpc_rlhf.data.synthetic import DEFAULT_MISTAKE_RATE, Problem, demonstrated_answers

CALL_OPEN = "<calc>"
CALL_CLOSE = "</calc>"  # the stop string that ends the model's turn when it calls the tool
DEFAULT_TOOL_SHARE = 0.25
# Numbers of up to 12 digits joined by + - *: enough for any arithmetic the task needs, never a huge computation.
_EXPRESSION = re.compile(r"\s*\d{1,12}(\s*[-+*]\s*\d{1,12})*\s*")
_TERM = re.compile(r"\d+|[-+*]")


def call_text(expression: str) -> str:
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def result_text(value: int | None) -> str:
    """The observation that answers a call: `=42` and a line break (`=?` when the expression is not one)."""
    return f"={'?' if value is None else value}\n"


def evaluate(expression: str) -> int | None:
    """The value of integers joined by + - * (usual precedence), or None when the text is not such an expression."""
    if not _EXPRESSION.fullmatch(expression):
        return None
    terms = _TERM.findall(expression)
    total, product, sign = 0, int(terms[0]), 1
    for op, number in zip(terms[1::2], terms[2::2]):
        if op == "*":
            product *= int(number)
        else:
            total += sign * product
            product, sign = int(number), (1 if op == "+" else -1)
    return total + sign * product


def tool_response(problem: Problem) -> str:
    """A demonstration that calls the tool on the problem and copies the result: `<calc>a+b</calc>=c\\nc`."""
    expression = f"{problem.a}+{problem.b}"
    return call_text(expression) + result_text(evaluate(expression)) + problem.answer


def tool_sft_rows(problems: Sequence[Problem], seed: int = 0, tool_share: float = DEFAULT_TOOL_SHARE,
                  mistake_rate: float = DEFAULT_MISTAKE_RATE) -> list[dict]:
    """{"prompt", "response"} demonstrations: round(tool_share x len) of them, drawn at random, call the tool;
    the others answer directly, exactly as synthetic.sft_rows does with the same seed and mistake rate."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be between 0 and 1, got {tool_share}")
    direct = demonstrated_answers(problems, seed, mistake_rate)
    rng = random.Random(f"hpc_rlhf.tool_task:tool:{seed}")  # a stream of its own (see synthetic._rng)
    with_tool = set(rng.sample(range(len(problems)), round(tool_share * len(problems))))
    return [{"prompt": p.prompt, "response": tool_response(p) if i in with_tool else direct[i]}
            for i, p in enumerate(problems)]
