"""The multi-turn episode driver with the hf rollout engine on a tiny random Llama: one generate call per turn,
trajectories token for token as sampled, masks with holes, aligned log-probs, stop strings, limits, repeats."""

from __future__ import annotations

import torch
import pytest

from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.envs.base import EnvError
from hpc_rlhf.envs.episodes import METRIC_SUMS, cut_at_stop_strings, metrics_from_sums, run_episodes
from hpc_rlhf.envs.transcript import Transcript
from tests.envs.conftest import Echo, Recorder, Scripted, factory, observation_for, settings

ROWS = [{"prompt": "17+25=", "answer": "42"}, {"prompt": "3+4=", "answer": "7"}, {"prompt": "60+9=", "answer": "69"}]
TEMPERATURE = 1.0


def play(engine, tokenizer, *, n=2, stop=(), seed=7, rows=ROWS, env=Echo, max_new_tokens=6, **overrides):
    recorder = Recorder(engine)
    transcript = Transcript(tokenizer, chat=False)
    prompts = [transcript.prompt_ids(r["prompt"], 16) for r in rows]
    sampling = SamplingParams(n=n, temperature=TEMPERATURE, max_new_tokens=max_new_tokens, seed=seed)
    batch = run_episodes(rows, prompts, recorder, sampling, env=factory(env, stop=stop), tokenizer=tokenizer,
                         settings=settings(**overrides))
    return batch, recorder


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def check_against_engine(batch, recorder, tokenizer, stop=()):
    """Rebuild every episode from the engine's recorded calls: each model turn is a prefix of what the engine
    sampled for that episode in that turn (cut only at a stop string or the token limit), with the same log-probs,
    and every observation is the one-time tokenisation of what the environment said."""
    for t, call in enumerate(recorder.calls):
        live = [e for e in batch.episodes if e.turns > t]
        assert len(call["prompts"]) == len(live), "a turn's generate call does not hold every live episode"
        for k, episode in enumerate(live):
            start, end = episode.turn_spans[t]
            assert call["prompts"][k] == episode.prompt_ids + episode.tokens[:start].tolist()
            sampled, kept = call["tokens"][k], episode.tokens[start:end].tolist()
            assert kept == sampled[:len(kept)], "a model turn differs from what the engine sampled"
            assert torch.equal(episode.logprobs[start:end], call["logprobs"][k][:len(kept)])
            if len(kept) < len(sampled):  # cut: by a stop string completed at its last token, or at the limit
                at_stop = any(s in decode(tokenizer, kept) for s in stop) and \
                    not any(s in decode(tokenizer, kept[:-1]) for s in stop)
                assert at_stop or (episode.truncated and end == len(episode.tokens)), (kept, sampled)
    for episode in batch.episodes:
        mask = episode.mask.tolist()
        for (start, end), nxt in zip(episode.turn_spans, episode.turn_spans[1:] + [(len(episode.tokens), None)]):
            assert all(mask[start:end]) and not any(mask[end:nxt[0]])
            between = episode.tokens[end:nxt[0]].tolist()
            if between:  # the observation that answered this turn, tokenised once
                action = decode(tokenizer, episode.tokens[start:end].tolist())
                assert between == tokenizer(observation_for(action), add_special_tokens=False)["input_ids"]
        assert (episode.logprobs[~episode.mask] == 0).all()


def test_one_generate_call_per_turn_and_trajectories_as_sampled(engine, tokenizer):
    batch, recorder = play(engine, tokenizer, n=2, max_turns=3, max_episode_tokens=200)
    assert batch.generate_calls == len(recorder.calls) == 3  # Echo is never done: every episode plays 3 turns
    assert [len(c["prompts"]) for c in recorder.calls] == [6, 6, 6]
    assert all(c["sampling"].n == 1 and c["sampling"].max_new_tokens == 6 for c in recorder.calls)
    check_against_engine(batch, recorder, tokenizer)
    for episode in batch.episodes:
        assert episode.turns == 3 and not episode.truncated and not episode.done
        first = tokenizer(f"<{ROWS[episode.row_index]['prompt']}>", add_special_tokens=False)["input_ids"]
        assert episode.tokens[:len(first)].tolist() == first and not episode.mask[:len(first)].any()
        assert episode.turn_rewards == [0.25] * 3 and episode.reward == 0.75 and episode.tool_calls == 3
    # prompt-major: row i, sample j at i * n + j
    assert [(e.row_index, e.sample_index) for e in batch.episodes] == [(i, j) for i in range(3) for j in range(2)]
    assert [t.tolist() for t in batch.tokens()] == [e.tokens.tolist() for e in batch.episodes]
    assert batch.masks()[0] is batch.episodes[0].mask and batch.logprobs()[5] is batch.episodes[5].logprobs
    assert batch.rewards().tolist() == [0.75] * 6
    metrics = batch.metrics()
    assert metrics["turns_mean"] == 3 and metrics["tool_calls_mean"] == 3 and metrics["episodes_truncated"] == 0
    assert 0 < metrics["env_time_share"] < 1
    sums = batch.metric_sums()
    assert list(sums) == list(METRIC_SUMS) and sums["turns"] == 18 and sums["episodes"] == 6
    # two engines' shards add up to the metrics of the whole step
    other = {**sums, "episodes": 2.0, "episodes_kept": 2.0, "turns": 2.0, "tool_calls": 0.0, "episodes_truncated": 1.0}
    total = metrics_from_sums({k: sums[k] + other[k] for k in sums})
    assert total["turns_mean"] == 20 / 8 and total["tool_calls_mean"] == 18 / 8 and total["episodes_truncated"] == 1


def test_log_probs_are_those_of_the_model_at_its_own_tokens(engine, model, tokenizer):
    batch, _ = play(engine, tokenizer, n=2, max_turns=3, max_episode_tokens=200)
    for episode in batch.episodes:
        ids = torch.tensor([episode.prompt_ids + episode.tokens.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = len(episode.prompt_ids)
        expected = torch.log_softmax(logits[p - 1:-1] / TEMPERATURE, -1).gather(1, episode.tokens[:, None])[:, 0]
        torch.testing.assert_close(episode.logprobs[episode.mask], expected[episode.mask], atol=2e-5, rtol=1e-5)


def test_stop_strings_cut_a_turn_after_the_token_that_completes_them(engine, tokenizer):
    # "ab" spans two tokens; "ser|" ends inside the single token <|user|>, which is then kept whole.
    stop = ("ab", "ser|")
    batch, recorder = play(engine, tokenizer, n=4, stop=stop, max_turns=3, max_episode_tokens=200,
                           max_new_tokens=8)
    check_against_engine(batch, recorder, tokenizer, stop=stop)
    cut = {s: 0 for s in stop}
    for episode in batch.episodes:
        for start, end in episode.turn_spans:
            text = decode(tokenizer, episode.tokens[start:end].tolist())
            for s in stop:
                cut[s] += text.endswith(s) or (s == "ser|" and text.endswith("<|user|>"))
            assert not any(s in decode(tokenizer, episode.tokens[start:end - 1].tolist()) for s in stop)
    assert cut["ab"] >= 1 and cut["ser|"] >= 1, cut  # both kinds of cut happened (seeded, so always)


def test_cut_at_stop_strings_on_token_lists(tokenizer):
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def dec(x):
        return decode(tokenizer, x)

    assert cut_at_stop_strings(ids("xx</calc>yy"), ["</calc>"], dec) == 9
    assert cut_at_stop_strings(ids("</calc>"), ["</calc>"], dec) == 7
    assert cut_at_stop_strings(ids("abcab"), ["ca", "b"], dec) == 2  # the first stop string to complete wins
    assert cut_at_stop_strings(ids("xyz"), ["</calc>"], dec) is None
    assert cut_at_stop_strings(ids("x<|user|>y"), ["ser"], dec) == 2
    assert cut_at_stop_strings(ids("xyz"), [], dec) is None


def test_max_turns_ends_episodes_and_no_call_is_made_after_the_last(engine, tokenizer):
    batch, recorder = play(engine, tokenizer, n=1, max_turns=2, max_episode_tokens=200)
    assert batch.generate_calls == 2 and all(e.turns == 2 for e in batch.episodes)
    # the observation of the last turn is not appended: the episode ends with the model's tokens
    assert all(bool(e.mask[-1]) for e in batch.episodes)


def test_max_episode_tokens_truncates_episodes_counting_observations(engine, tokenizer):
    limit = 20
    batch, recorder = play(engine, tokenizer, n=2, max_turns=5, max_episode_tokens=limit, max_new_tokens=8)
    check_against_engine(batch, recorder, tokenizer)
    assert all(len(e.tokens) <= limit for e in batch.episodes)
    assert all(e.truncated for e in batch.episodes)  # Echo never ends an episode: each one runs into the limit
    assert batch.metrics()["episodes_truncated"] == len(batch.episodes)
    # generate is never asked for more tokens than the roomiest live episode has left
    for t, call in enumerate(recorder.calls):
        live = [e for e in batch.episodes if e.turns > t]
        room = max(limit - e.turn_spans[t][0] for e in live)
        assert call["sampling"].max_new_tokens == min(8, room)


def test_same_seed_repeats_bit_for_bit_and_another_seed_does_not(engine, tokenizer):
    first, _ = play(engine, tokenizer, n=2, seed=11, stop=("ab",))
    again, _ = play(engine, tokenizer, n=2, seed=11, stop=("ab",))
    other, _ = play(engine, tokenizer, n=2, seed=12, stop=("ab",))
    for a, b in zip(first.episodes, again.episodes):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
        assert torch.equal(a.logprobs, b.logprobs) and a.turn_spans == b.turn_spans
    assert any(not torch.equal(a.tokens, c.tokens) for a, c in zip(first.episodes, other.episodes))


class Ends:
    """Done after the first turn when the action holds an 'a', else after the second."""

    def reset(self, row):
        self.turn = 0
        return ""

    def step(self, action):
        self.turn += 1
        return "?", 1.0, "a" in action or self.turn == 2


def test_done_episodes_leave_the_batch_and_later_calls_hold_only_live_ones(engine, tokenizer):
    batch, recorder = play(engine, tokenizer, n=4, env=Ends, max_turns=4, max_episode_tokens=200)
    assert batch.generate_calls <= 2 and all(e.done and e.turns <= 2 for e in batch.episodes)
    if batch.generate_calls == 2:
        assert len(recorder.calls[1]["prompts"]) == sum(e.turns == 2 for e in batch.episodes)
    assert any(e.turns == 1 for e in batch.episodes) and any(e.turns == 2 for e in batch.episodes)


def test_lockstep_calls_generate_every_turn_even_with_no_episode_left(engine, tokenizer):
    recorder = Recorder(engine)
    sampling = SamplingParams(n=1, max_new_tokens=4, seed=1)
    transcript = Transcript(tokenizer, chat=False)
    batch = run_episodes(ROWS[:1], [transcript.prompt_ids("1+1=", 16)], recorder, sampling,
                         env=factory(Ends), tokenizer=tokenizer, settings=settings(max_turns=4), lockstep=True)
    assert batch.generate_calls == len(recorder.calls) == 4
    assert [len(c["prompts"]) for c in recorder.calls][2:] == [0, 0]


def test_greedy_decoding_with_several_samples_is_refused(tokenizer):
    with pytest.raises(ValueError, match="greedy decoding .* n=2 identical episodes"):
        run_episodes(ROWS, [[1, 5]] * 3, Scripted(tokenizer, ["1"]), SamplingParams(n=2, temperature=0),
                     env=factory(Echo), tokenizer=tokenizer, settings=settings())


def test_the_model_turn_is_given_to_the_environment_as_decoded_text(tokenizer):
    actions = []

    class Keeps:
        def reset(self, row):
            return ""

        def step(self, action):
            actions.append(action)
            return "", 0.0, True

    scripted = Scripted(tokenizer, ["12<eos>"])
    run_episodes([ROWS[0]], [[1, 5]], scripted, SamplingParams(max_new_tokens=8), env=factory(Keeps),
                 tokenizer=tokenizer, settings=settings())
    assert actions == ["12<eos>"]


def test_model_tokens_are_kept_as_sampled_never_re_encoded(tokenizer):
    # The characters < e o s > sampled one by one decode to "<eos>", which would encode back to ONE token (the
    # special <eos>): the episode must keep the five ids the model sampled.
    sampled = [tokenizer.convert_tokens_to_ids(c) for c in "<eos>"] + [tokenizer.convert_tokens_to_ids("x")]
    assert tokenizer(decode(tokenizer, sampled), add_special_tokens=False)["input_ids"] != sampled
    actions = []

    class Keeps:
        def reset(self, row):
            return ""

        def step(self, action):
            actions.append(action)
            return "", 0.0, True

    batch = run_episodes([ROWS[0]], [[1, 5]], Scripted(tokenizer, [sampled]), SamplingParams(max_new_tokens=8),
                         env=factory(Keeps), tokenizer=tokenizer, settings=settings())
    assert batch.episodes[0].tokens.tolist() == sampled and actions == ["<eos>x"]


@pytest.mark.parametrize("bad, message", [
    (lambda: ("ok", float("nan"), False),
     "environment 'test-env' on row 0 {'prompt': '17+25=', 'answer': '42'}: step returned reward nan; rewards "
     "must be finite"),
    (lambda: (["not", "text"], 0.0, False),
     "environment 'test-env' on row 0 {'prompt': '17+25=', 'answer': '42'}: step returned an observation of type "
     "list (['not', 'text']); observations must be text (str)"),
    (lambda: ("ok", "1.0", False), "step returned reward '1.0' (str); rewards must be numbers"),
    (lambda: ("ok", 1.0, "yes"), "step returned done='yes' (str); done must be true or false"),
    (lambda: ("ok", 1.0), "step returned ('ok', 1.0); it must return (observation, reward, done) or"),
    (lambda: ("ok", 1.0, False, {"tool_calls": -1}), "step returned info['tool_calls']=-1; it must be a count"),
    (lambda: 1 / 0, "environment 'test-env' on row 0 {'prompt': '17+25=', 'answer': '42'}: step raised "
                    "ZeroDivisionError: division by zero"),
    (lambda: ("ok", 10 ** 400, False), "step returned reward 1000000000000000000000000000000000000..., too large "
                                       "for a float; rewards must be finite"),
    (lambda: ("ok", 1e39, False), "step returned reward 1e+39, past float32's range (|reward| <= 3.403e+38)"),
])
def test_bad_steps_stop_with_one_line_naming_environment_row_and_fault(tokenizer, bad, message):
    class Bad:
        def reset(self, row):
            return ""

        def step(self, action):
            return bad()

    with pytest.raises(EnvError) as caught:
        run_episodes([ROWS[0]], [[1, 5]], Scripted(tokenizer, ["1"]), SamplingParams(max_new_tokens=4),
                     env=factory(Bad), tokenizer=tokenizer, settings=settings())
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("reset, message", [
    (lambda row: 42, "on row 0 {'prompt': '17+25=', 'answer': '42'}: reset returned an observation of type int (42)"),
    (lambda row: row["missing"], "on row 0 {'prompt': '17+25=', 'answer': '42'}: reset raised KeyError: 'missing'"),
])
def test_bad_resets_stop_with_one_line(tokenizer, reset, message):
    class Bad:
        def reset(self, row):
            return reset(row)

        def step(self, action):
            return "", 0.0, True

    with pytest.raises(EnvError) as caught:
        run_episodes([ROWS[0]], [[1, 5]], Scripted(tokenizer, ["1"]), SamplingParams(max_new_tokens=4),
                     env=factory(Bad), tokenizer=tokenizer, settings=settings())
    assert str(caught.value).startswith("environment 'test-env' " + message)


def test_the_row_is_named_by_its_source_when_it_has_one(tokenizer):
    class Raises:
        def reset(self, row):
            raise RuntimeError("tool server\nis down")

    row = {"prompt": "1+1=", "answer": "2", "_source": "data/p.jsonl, line 3"}
    with pytest.raises(EnvError) as caught:
        run_episodes([row], [[1, 5]], Scripted(tokenizer, ["1"]), SamplingParams(n=2, max_new_tokens=4),
                     env=factory(Raises), tokenizer=tokenizer, settings=settings())
    assert str(caught.value) == ("environment 'test-env' on data/p.jsonl, line 3 {'prompt': '1+1=', 'answer': '2'}, "
                                 "sample 0: reset raised RuntimeError: tool server is down")


def test_a_hanging_step_ends_within_its_timeout_or_only_its_episode_with_skip(tokenizer):
    import threading
    release = threading.Event()

    class HangsOnRowOne:
        def reset(self, row):
            self.row = row
            return ""

        def step(self, action):
            if self.row["prompt"] == ROWS[1]["prompt"]:
                release.wait(30)
            return "", 1.0, True

    try:
        with pytest.raises(EnvError, match=r"on row 1 .*: step did not return within 0.3 s"):
            run_episodes(ROWS, [[1, 5]] * 3, Scripted(tokenizer, ["1"]), SamplingParams(max_new_tokens=4),
                         env=factory(HangsOnRowOne, timeout_s=0.3), tokenizer=tokenizer, settings=settings())
        batch = run_episodes(ROWS, [[1, 5]] * 3, Scripted(tokenizer, ["1"]), SamplingParams(max_new_tokens=4),
                             env=factory(HangsOnRowOne, timeout_s=0.3), tokenizer=tokenizer,
                             settings=settings(on_error="skip"))
    finally:
        release.set()
    assert [e.failed for e in batch.episodes] == [False, True, False]
    dropped = batch.episodes[1]
    assert "step did not return within 0.3 s" in dropped.error and not dropped.mask.any()
    assert [e.reward for e in batch.episodes if not e.failed] == [1.0, 1.0]
    assert batch.metrics()["episodes_failed"] == 1 and batch.metrics()["turns_mean"] == 1


def test_environment_calls_of_a_turn_run_concurrently_up_to_the_bound(tokenizer):
    import threading
    import time
    lock, running, peak = threading.Lock(), [0], [0]

    class Slow:
        def reset(self, row):
            return ""

        def step(self, action):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.15)
            with lock:
                running[0] -= 1
            return "", 0.0, True

    rows = [{"prompt": f"{i}+1="} for i in range(8)]
    started = time.perf_counter()
    batch = run_episodes(rows, [[1, 5]] * 8, Scripted(tokenizer, ["1"]), SamplingParams(max_new_tokens=4),
                         env=factory(Slow), tokenizer=tokenizer, settings=settings(max_concurrency=3))
    elapsed = time.perf_counter() - started
    assert peak[0] == 3 and len(batch.episodes) == 8
    assert 0.45 <= elapsed < 1.2  # ceil(8 / 3) = 3 rounds of 0.15 s, not 8
    assert batch.env_s >= 0.45 and all(e.env_time_s >= 0.15 for e in batch.episodes)


def test_a_weighted_episode_reward_past_float32_drops_the_episode_with_skip(tokenizer):
    """Each turn's reward fits float32, their sum times env.reward_weight does not: named where it happens."""
    class Big:
        def reset(self, row):
            return ""

        def step(self, action):
            return "", 3e38, False

    batch = run_episodes([ROWS[0]], [[1, 5]], Scripted(tokenizer, ["1", "2"]), SamplingParams(max_new_tokens=4),
                         env=factory(Big), tokenizer=tokenizer, settings=settings(on_error="skip", max_turns=2))
    episode = batch.episodes[0]
    assert episode.failed and not episode.mask.any()
    assert episode.error.startswith("environment 'test-env' on row 0 {'prompt': '17+25=', 'answer': '42'}: the "
                                    "episode's reward so far times env.reward_weight is 6e+38, not finite in float32")


def test_environment_calls_run_inside_what_the_caller_names_them(tokenizer):
    """`waiting` wraps each turn's calls (the RL recipe puts the environment in the rank's watchdog phase)."""
    import contextlib
    named = []

    @contextlib.contextmanager
    def waiting(what):
        named.append(what)
        yield

    run_episodes([ROWS[0]], [[1, 5]], Scripted(tokenizer, ["1", "2"]), SamplingParams(max_new_tokens=4),
                 env=factory(Echo), tokenizer=tokenizer, settings=settings(max_turns=2), waiting=waiting)
    assert named == ["environment test-env"] * 3  # the resets, then each turn's steps
