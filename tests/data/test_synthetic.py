import pytest

from hpc_rlhf.data import synthetic
from hpc_rlhf.data.synthetic import Problem, exact_match, extract_answer


def test_problem_by_hand():
    assert Problem(17, 25).prompt == "17+25="
    assert Problem(17, 25).answer == "42"
    assert Problem(17, 25).carries and Problem(17, 25).dropped_carry_answer == "32"
    assert Problem(57, 68).dropped_carry_answer == "115"   # 125 with the units' one forgotten
    assert Problem(95, 9).dropped_carry_answer == "94"     # 104 -> 94
    assert not Problem(50, 55).carries                     # 105: a carry into the hundreds only
    assert Problem(5, 5).carries and not Problem(4, 5).carries
    with pytest.raises(ValueError, match="50\\+55= has no carry"):
        Problem(50, 55).dropped_carry_answer
    # Carries happen for 45 of the 100 pairs of units digits.
    assert sum(p.carries for p in synthetic.all_problems()) == 4500


def test_split_is_disjoint_complete_and_seeded():
    split = synthetic.split_problems(seed=0)
    assert len(split.heldout) == 500 and len(split.train) == 9500
    assert not set(split.train) & set(split.heldout)
    assert set(split.train) | set(split.heldout) == set(synthetic.all_problems())
    assert synthetic.split_problems(seed=0) == split
    assert synthetic.split_problems(seed=1).heldout != split.heldout
    assert len(synthetic.split_problems(seed=0, num_heldout=30).heldout) == 30
    with pytest.raises(ValueError, match="num_heldout"):
        synthetic.split_problems(seed=0, num_heldout=0)


@pytest.mark.parametrize("rate", [0.0, 0.25, 0.6, 1.0])
def test_sft_mistakes_are_the_set_share_of_carry_problems_only(rate):
    problems = synthetic.split_problems(seed=3).train
    rows = synthetic.sft_rows(problems, seed=3, mistake_rate=rate)
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    carry_rows = [(p, r) for p, r in zip(problems, rows) if p.carries]
    wrong = [(p, r) for p, r in carry_rows if r["response"] != p.answer]
    assert len(wrong) == round(rate * len(carry_rows))
    # Every mistake is the dropped carry; no problem without a carry is ever wrong.
    assert all(r["response"] == p.dropped_carry_answer for p, r in wrong)
    assert all(r["response"] == p.answer for p, r in zip(problems, rows) if not p.carries)


def test_sft_mistakes_are_seeded():
    problems = synthetic.split_problems(seed=0).train
    assert synthetic.sft_rows(problems, seed=0) == synthetic.sft_rows(problems, seed=0)
    assert synthetic.sft_rows(problems, seed=0) != synthetic.sft_rows(problems, seed=1)
    with pytest.raises(ValueError, match="mistake_rate must be between 0 and 1, got 1.5"):
        synthetic.sft_rows(problems, mistake_rate=1.5)


def _digits(n: str) -> tuple[int, int]:
    value = int(n)
    return value % 10, value // 10 % 10


def test_preference_rejected_is_one_digit_wrong_units_and_tens_both_probed():
    problems = synthetic.all_problems()
    rows = synthetic.preference_rows(problems, seed=0)
    kinds = {"dropped": 0, "units": 0, "tens+": 0, "tens-": 0}
    for p, row in zip(problems, rows):
        assert row["prompt"] == p.prompt and row["chosen"] == p.answer
        rejected = int(row["rejected"])
        assert rejected >= 0 and rejected != p.total
        units, tens = _digits(row["rejected"])
        if units != p.total % 10:  # a wrong units digit, everything else right
            assert rejected // 10 == p.total // 10
            kinds["units"] += 1
        else:  # the tens digit one up or one down
            assert abs(rejected - p.total) == 10
            kinds["dropped" if p.carries and row["rejected"] == p.dropped_carry_answer else
                  "tens+" if rejected > p.total else "tens-"] += 1
    # Carry problems get the dropped carry at least half the time; wrong units and both tens directions occur.
    carry = sum(p.carries for p in problems)
    assert kinds["dropped"] >= 0.5 * carry
    assert all(0.1 < kinds[k] / len(rows) for k in ("units", "tens+", "tens-")), kinds
    assert 0.3 < kinds["units"] / len(rows) < 0.5, kinds


def test_kto_rows_are_balanced_and_labelled_by_correctness():
    problems = synthetic.split_problems(seed=0).heldout
    rows = synthetic.kto_rows(problems, seed=0)
    assert sum(r["label"] for r in rows) == len(rows) // 2
    for p, row in zip(problems, rows):
        assert isinstance(row["label"], bool)
        assert row["label"] == (row["completion"] == p.answer)
        assert exact_match(row["completion"], p.answer) == float(row["label"])


def test_prompt_rows():
    assert synthetic.prompt_rows([Problem(3, 99), Problem(0, 0)]) == [
        {"prompt": "3+99=", "answer": "102"}, {"prompt": "0+0=", "answer": "0"}]


def test_chat_rows_cover_the_problems_in_turns():
    problems = synthetic.split_problems(seed=0).train[:200]
    rows = synthetic.chat_rows(problems, seed=0, mistake_rate=0.6)
    turns = [len(r["messages"]) // 2 for r in rows]
    assert all(2 <= t <= 3 for t in turns[:-1]) and 1 <= turns[-1] <= 3 and sum(turns) == 200
    messages = [m for r in rows for m in r["messages"]]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 200
    assert [m["content"] for m in messages[::2]] == [p.prompt for p in problems]
    # The assistant's answers are the same imperfect demonstrations as the SFT rows.
    assert [m["content"] for m in messages[1::2]] == [r["response"] for r in synthetic.sft_rows(problems, seed=0)]


@pytest.mark.parametrize("response, answer, reward", [
    ("42", "42", 1.0),
    (" 42 \n", "42", 1.0),
    ("42<eos>", "42", 1.0),
    ("42 <eos><pad><pad>", "42", 1.0),
    ("42<eos>7", "42", 0.0),
    ("32", "42", 0.0),
    ("042", "42", 0.0),
    ("42 is it", "42", 0.0),
    ("", "42", 0.0),
    ("<eos>", "0", 0.0),
    ("102</s>", "102", 0.0),
])
def test_exact_match(response, answer, reward):
    assert exact_match(response, answer) == reward


def test_exact_match_other_eos_text():
    assert exact_match("102</s>", "102", eos_text="</s>") == 1.0


@pytest.mark.parametrize("text, answer", [
    ("42", "42"),
    ("17+25=42<eos><pad>", "42"),
    (" 105\n3+4=7", "105"),
    ("the answer is 9", "9"),
    ("no number", ""),
    ("1+1=", ""),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_worked_solutions_carry_the_one_and_put_each_mistake_where_its_label_says():
    problem = synthetic.Problem(17, 25)
    assert synthetic.solution_steps(problem) == ["7+5=12", "1+2+1=4", "42"]
    assert synthetic.solution_steps(problem, "carry") == ["7+5=12", "1+2=3", "32"]
    assert synthetic.solution_steps(problem, "units", digit=3) == ["7+5=13", "1+2+1=4", "43"]
    assert synthetic.solution_steps(problem, "answer", digit=9) == ["7+5=12", "1+2+1=4", "49"]
    assert synthetic.solution_steps(synthetic.Problem(3, 4)) == ["3+4=7", "0+0=0", "7"]
    with pytest.raises(ValueError, match="no carry"):
        synthetic.solution_steps(synthetic.Problem(3, 4), "carry")


def test_process_rows_label_every_step_from_the_first_wrong_one_on():
    problems = synthetic.split_problems(0).train[:2000]
    rows = synthetic.process_rows(problems, seed=0)
    assert rows == synthetic.process_rows(problems, seed=0)
    right = 0
    for problem, row in zip(problems, rows):
        text, labels = row["input"], row["label"]
        assert text.startswith(problem.prompt) and text.count(synthetic.STEP_MARK) == len(labels) == 3
        steps = text[len(problem.prompt):].split(synthetic.STEP_MARK)[:3]
        # A step is right when it is the right solution's step and every step before it is too.
        good = [steps[:k + 1] == synthetic.solution_steps(problem)[:k + 1] for k in range(3)]
        assert labels == [synthetic.GOOD_STEP if g else synthetic.BAD_STEP for g in good], row
        right += all(good)
    assert 0.45 < right / len(rows) < 0.55
