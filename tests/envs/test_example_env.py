"""The example environment of examples/envs/ (a user's 30-line class), named by its file and played by the
episode driver with the hf engine; and its rules, checked on scripted turns."""

from pathlib import Path

from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.episodes import run_episodes
from hpc_rlhf.envs.loading import load_environment
from hpc_rlhf.envs.transcript import Transcript
from tests.envs.conftest import Recorder, Scripted

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "digit_hint.py"
ROWS = [{"prompt": "17+25=", "answer": "42"}, {"prompt": "5+4=", "answer": "9"}]


def play(generate, tokenizer, n=1):
    section = EnvSection(name=f"{EXAMPLE}:DigitHint", max_turns=2, max_episode_tokens=64)
    transcript = Transcript(tokenizer, chat=False)
    prompts = [transcript.prompt_ids(r["prompt"], 16) for r in ROWS]
    return run_episodes(ROWS, prompts, generate, SamplingParams(n=n, max_new_tokens=5, seed=3),
                        env=load_environment(section), tokenizer=tokenizer, settings=section)


def test_the_example_is_short():
    code = [line for line in EXAMPLE.read_text().split('"""')[-1].splitlines() if line.strip()]
    assert len(EXAMPLE.read_text().splitlines()) <= 30 and len(code) <= 22


def test_the_example_runs_through_the_driver_with_the_engine(engine, tokenizer):
    recorder = Recorder(engine)
    batch = play(recorder, tokenizer, n=3)
    assert len(batch.episodes) == 6 and batch.generate_calls == len(recorder.calls) <= 2
    for episode in batch.episodes:
        assert 1 <= episode.turns <= 2 and episode.done and not episode.failed
        assert episode.mask.sum() == sum(end - start for start, end in episode.turn_spans)
        if episode.turns == 2:  # a wrong first answer got the hint and the question again
            hint = episode.tokens[episode.turn_spans[0][1]:episode.turn_spans[1][0]].tolist()
            text = tokenizer.decode(hint)
            assert text.startswith(" (") and text.endswith(")\n" + ROWS[episode.row_index]["prompt"])


def test_the_example_rewards_a_right_answer_and_a_corrected_one(tokenizer):
    # every live episode gets the same scripted turn: row 0 (17+25) and row 1 (5+4)
    right, wrong_twice = play(Scripted(tokenizer, ["42<eos>", "7<eos>"]), tokenizer).episodes
    assert right.turns == 1 and right.reward == 1.0
    assert wrong_twice.turns == 2 and wrong_twice.reward == 0.0 and wrong_twice.done
    corrected, late = play(Scripted(tokenizer, ["32<eos>", "42<eos>"]), tokenizer).episodes
    assert corrected.turns == 2 and corrected.reward == 0.5 and late.reward == 0.0
    between = corrected.tokens[corrected.turn_spans[0][1]:corrected.turn_spans[1][0]].tolist()
    assert tokenizer.decode(between) == " (wrong tens digit)\n17+25="
