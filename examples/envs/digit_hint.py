"""An environment in 30 lines: answer the tiny task; a wrong answer gets a hint and one more try.

    hpc-rlhf grpo --config examples/tiny/grpo.yaml env.name=examples/envs/digit_hint.py:DigitHint env.max_turns=2

A wrong first answer is told which digit is wrong (the dropped carry of the tiny SFT data makes the tens digit
wrong), then sees the question again. Reward: 1 for a right first answer, 0.5 for a right second one.
"""


class DigitHint:
    def reset(self, row: dict) -> str:
        self.question, self.answer, self.tries = row["prompt"], str(row["answer"]), 0
        return ""  # nothing to add: the prompt already asks the question

    def step(self, action: str) -> tuple[str, float, bool]:
        self.tries += 1
        guess = action.replace("<eos>", "").strip()
        if guess == self.answer:
            return "", 1.0 if self.tries == 1 else 0.5, True
        if self.tries == 2:
            return "", 0.0, True
        return f" ({self._hint(guess)})\n{self.question}", 0.0, False

    def _hint(self, guess: str) -> str:
        if len(guess) != len(self.answer) or not guess.isdigit():
            return f"the answer has {len(self.answer)} digits"
        names = ("units", "tens", "hundreds")
        wrong = [names[i] for i, (a, b) in enumerate(zip(guess[::-1], self.answer[::-1])) if a != b]
        return f"wrong {' and '.join(wrong)} digit"
