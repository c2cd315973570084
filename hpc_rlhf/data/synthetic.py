"""The built-in task: two-digit addition, "a+b=" -> "c" with a and b in 0..99 (DESIGN §7).

The answer can be checked by rule, so the demo and the tests can measure whether training helps. On clean
demonstrations RL gains nothing that more SFT would not, so the SFT demonstrations are imperfect the way
human data is: a fixed share (`mistake_rate`, 0.6 by default) of the answers to problems with a carry from
the units into the tens "forget to carry the one" and are 10 too small (17+25= -> "32"). Imitation then
plateaus below what the exact-match reward, or a reward model trained on correct preferences, can reach.

Everything here is pure Python and deterministic from the seed. Held-out rows (evaluation) always have
correct answers; the mistakes exist only in SFT training demonstrations.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

DEFAULT_MISTAKE_RATE = 0.6
DEFAULT_NUM_HELDOUT = 500
EOS_TEXT = "<eos>"
PAD_TEXT = "<pad>"


@dataclass(frozen=True, order=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def total(self) -> int:
        return self.a + self.b

    @property
    def answer(self) -> str:
        return str(self.total)

    @property
    def carries(self) -> bool:
        """True when the units digits add up to 10 or more, so a one is carried into the tens."""
        return self.a % 10 + self.b % 10 >= 10

    @property
    def dropped_carry_answer(self) -> str:
        """The systematic mistake: the carried one is forgotten, so the tens digit is one too small."""
        if not self.carries:
            raise ValueError(f"{self.prompt} has no carry, so it has no dropped-carry answer")
        return str(self.total - 10)


class Split(NamedTuple):
    train: list[Problem]
    heldout: list[Problem]


def _rng(seed: int, purpose: str) -> random.Random:
    # One stream per purpose, so changing how one file is drawn does not reshuffle the others.
    # Seeding with a string is stable across processes and Python runs (it is hashed with SHA-512).
    return random.Random(f"hpc_rlhf.synthetic:{purpose}:{seed}")


def all_problems() -> list[Problem]:
    return [Problem(a, b) for a in range(100) for b in range(100)]


def split_problems(seed: int = 0, num_heldout: int = DEFAULT_NUM_HELDOUT) -> Split:
    """All 10,000 problems shuffled and cut into disjoint training and held-out sets.

    "a+b=" and "b+a=" are different prompts and may fall on different sides: the held-out set measures
    generalisation to unseen prompts, and commutativity is part of what the model has to learn.
    """
    problems = all_problems()
    if not 1 <= num_heldout < len(problems):
        raise ValueError(f"num_heldout must be between 1 and {len(problems) - 1}, got {num_heldout}")
    _rng(seed, "split").shuffle(problems)
    return Split(train=problems[num_heldout:], heldout=problems[:num_heldout])


def _check_rate(mistake_rate: float) -> None:
    if not 0.0 <= mistake_rate <= 1.0:
        raise ValueError(f"mistake_rate must be between 0 and 1, got {mistake_rate}")


def _mistaken(problems: Sequence[Problem], mistake_rate: float, rng: random.Random) -> set[int]:
    """Indices of exactly round(mistake_rate x number of carry problems) carry problems."""
    _check_rate(mistake_rate)
    carry_indices = [i for i, problem in enumerate(problems) if problem.carries]
    return set(rng.sample(carry_indices, round(mistake_rate * len(carry_indices))))


def demonstrated_answers(problems: Sequence[Problem], seed: int = 0,
                         mistake_rate: float = DEFAULT_MISTAKE_RATE) -> list[str]:
    """The answers a demonstrator gives: right, except the chosen share of carry problems (dropped carry)."""
    mistaken = _mistaken(problems, mistake_rate, _rng(seed, "sft"))
    return [p.dropped_carry_answer if i in mistaken else p.answer for i, p in enumerate(problems)]


def sft_rows(problems: Sequence[Problem], seed: int = 0,
             mistake_rate: float = DEFAULT_MISTAKE_RATE) -> list[dict]:
    """{"prompt", "response"} demonstrations; use mistake_rate=0 for evaluation rows."""
    answers = demonstrated_answers(problems, seed, mistake_rate)
    return [{"prompt": p.prompt, "response": answer} for p, answer in zip(problems, answers)]


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong answer: one digit of the right one changed.

    Half of the carry problems get the dropped carry, the very mistake the SFT data teaches; every other pair
    gets, at even odds, a wrong units digit or the tens digit one up or down. A judge trained on these pairs
    must check both digits: one trained on tens-digit mistakes only ranked wrong units digits as right, and PPO
    against it learned to carry while its units digits drifted (held-out exact match 0.69 -> 0.53).
    """
    if problem.carries and rng.random() < 0.5:
        return problem.dropped_carry_answer
    if rng.random() < 0.5:
        units = problem.total % 10
        return str(problem.total - units + rng.choice([d for d in range(10) if d != units]))
    if problem.total < 10 or rng.random() < 0.5:
        return str(problem.total + 10)
    return str(problem.total - 10)


def preference_rows(problems: Sequence[Problem], seed: int = 0) -> list[dict]:
    """{"prompt", "chosen", "rejected"}: chosen is the right sum, rejected a wrong one (see wrong_answer)."""
    rng = _rng(seed, "preference")
    return [{"prompt": p.prompt, "chosen": p.answer, "rejected": wrong_answer(p, rng)} for p in problems]


def kto_rows(problems: Sequence[Problem], seed: int = 0) -> list[dict]:
    """{"prompt", "completion", "label"}: one row per problem, half of them (rounded down) desirable."""
    rng = _rng(seed, "kto")
    desirable = set(rng.sample(range(len(problems)), len(problems) // 2))
    rows = []
    for i, problem in enumerate(problems):
        good = i in desirable
        completion = problem.answer if good else wrong_answer(problem, rng)
        rows.append({"prompt": problem.prompt, "completion": completion, "label": good})
    return rows


STEP_MARK = "#"  # ends each step of a worked solution (process_rows); one token of the character tokenizer
GOOD_STEP, BAD_STEP = "+", "-"


def solution_steps(problem: Problem, mistake: str | None = None, digit: int = 0) -> list[str]:
    """A worked solution in three steps: the units digits' sum, the tens digits' sum with the carried one,
    and the answer. 17+25= -> ["7+5=12", "1+2+1=4", "42"]. `mistake` puts one error in: "units" (the units sum
    is off: `digit` is a wrong units digit of it), "carry" (the dropped carry: 1+2=3, then 32; carry problems
    only) or "answer" (right steps, then an answer with a wrong units digit `digit`); every step after a wrong
    one follows from it."""
    units_a, units_b, tens_a, tens_b = problem.a % 10, problem.b % 10, problem.a // 10, problem.b // 10
    units = units_a + units_b
    if mistake == "units":
        units = units - units % 10 + digit
    carry = units // 10
    if mistake == "carry":
        if not problem.carries:
            raise ValueError(f"{problem.prompt} has no carry to drop")
        carry = 0
    tens = tens_a + tens_b + carry
    carried = f"+{carry}" if carry else ""
    answer = tens * 10 + units % 10
    if mistake == "answer":
        answer = answer - answer % 10 + digit
    elif mistake not in (None, "units", "carry"):
        raise ValueError(f"unknown mistake {mistake!r}: units, carry, answer or None")
    return [f"{units_a}+{units_b}={units}", f"{tens_a}+{tens_b}{carried}={tens}", str(answer)]


def process_rows(problems: Sequence[Problem], seed: int = 0) -> list[dict]:
    """{"input", "label"}: a worked solution with STEP_MARK after each step, and one label per step: GOOD_STEP
    while every step so far is right, BAD_STEP from the first wrong one on (what a process reward model learns).
    Half of the solutions are right; the others hold one mistake: the dropped carry on half of the carry
    problems, else at even odds a wrong units sum or a wrong answer after right steps."""
    rng = _rng(seed, "process")
    rows = []
    for problem in problems:
        mistake, first_bad = None, 3
        if rng.random() < 0.5:
            if problem.carries and rng.random() < 0.5:
                mistake, first_bad = "carry", 1
            else:
                mistake, first_bad = rng.choice([("units", 0), ("answer", 2)])
        right = (problem.a % 10 + problem.b % 10) % 10 if mistake == "units" else problem.total % 10
        digit = rng.choice([d for d in range(10) if d != right])
        steps = solution_steps(problem, mistake, digit)
        rows.append({"input": problem.prompt + "".join(step + STEP_MARK for step in steps),
                     "label": [GOOD_STEP if k < first_bad else BAD_STEP for k in range(len(steps))]})
    return rows


def prompt_rows(problems: Sequence[Problem]) -> list[dict]:
    """{"prompt", "answer"} for RL and evaluation with the exact-match reward."""
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems]


def chat_rows(problems: Sequence[Problem], seed: int = 0, mistake_rate: float = DEFAULT_MISTAKE_RATE,
              min_turns: int = 2, max_turns: int = 3) -> list[dict]:
    """{"messages": [...]}: the problems in order, grouped into chats of min_turns..max_turns exchanges.

    The assistant's answers are demonstrations like sft_rows (the same share of dropped carries), so a
    chat-format SFT run meets the same imperfect data as the plain one.
    """
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got min_turns={min_turns}, max_turns={max_turns}")
    answers = demonstrated_answers(problems, seed, mistake_rate)
    rng = _rng(seed, "chat")
    rows, start = [], 0
    while start < len(problems):
        end = min(len(problems), start + rng.randint(min_turns, max_turns))
        messages = []
        for problem, answer in zip(problems[start:end], answers[start:end]):
            messages.append({"role": "user", "content": problem.prompt})
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
        start = end
    return rows


def _strip_end_tokens(text: str, eos_text: str) -> str:
    # Decoded rollouts end with <eos> and, in a padded batch, <pad> texts after it.
    text = text.strip()
    endings = tuple(t for t in (eos_text, PAD_TEXT) if t)
    while endings and text.endswith(endings):
        for ending in endings:
            text = text.removesuffix(ending)
        text = text.rstrip()
    return text


def extract_answer(text: str, eos_text: str = EOS_TEXT) -> str:
    """The first number in the answer of a generated text, "" when there is none. The answer ends at the
    first end-of-sequence text or line break (a model may go on with a new problem) and starts after the
    last "=" before that, when the text includes the prompt."""
    if eos_text:
        text = text.split(eos_text, 1)[0]
    text = text.lstrip().split("\n", 1)[0].rsplit("=", 1)[-1]
    match = re.search(r"-?\d+", text)
    return match.group(0) if match else ""


def exact_match(response: str, answer: str, eos_text: str = EOS_TEXT) -> float:
    """The rule reward: 1.0 when the response is exactly the answer (ignoring surrounding whitespace and a
    trailing end-of-sequence text), else 0.0. "42 is it" or "042" for "42" earn nothing."""
    return 1.0 if _strip_end_tokens(response, eos_text) == answer.strip() else 0.0
