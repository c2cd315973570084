"""Built-in environment: guess the sum of the tiny task, with higher/lower feedback after a wrong guess.

The model answers the row's prompt (`17+25=`); a right answer ends the episode, a wrong one gets `higher` or
`lower` (or `not a number`), a line break and the prompt again, and the model guesses again until env.max_turns.
So the next observation depends on the previous action, and the reward of a late right guess depends on the
earlier turns: the right guess earns 1.0 in the first turn, 0.5 in the second, 0.25 in the third, and so on.
"""

from __future__ import annotations

from hpc_rlhf.data.synthetic import extract_answer
from hpc_rlhf.envs.base import EnvError, Environment


class GuessNumber(Environment):
    def __init__(self):
        self.secret: int | None = None
        self.prompt = ""
        self.turn = 0

    def reset(self, row: dict) -> str:
        try:
            self.secret = int(str(row["answer"]).strip())
        except (KeyError, TypeError, ValueError):
            raise EnvError(f"guess_number needs an integer 'answer' in the row, got {row.get('answer')!r}") from None
        self.prompt = str(row.get("prompt", ""))
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turn += 1
        guess = extract_answer(action)
        if guess and int(guess) == self.secret:
            return "", 0.5 ** (self.turn - 1), True
        hint = "not a number" if not guess else "higher" if self.secret > int(guess) else "lower"
        return f"{hint}\n{self.prompt}", 0.0, False
