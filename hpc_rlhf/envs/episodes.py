"""Multi-turn episodes: the model acts, the environment answers, until the episode ends (DESIGN §4, last paragraph).

`run_episodes` plays `sampling.n` episodes for every row of a batch, with any rollout engine: it only needs a
`generate(prompt id lists, sampling)` callable (a RolloutEngine's `generate`, or one returning
(token id tensors, log-prob tensors)). Every turn, all live episodes go to the engine in ONE generate call
(one sample each, the context so far as the prompt), then their environments answer, concurrently.

What an episode keeps, token for token:
    prompt_ids   the prompt
    tokens       everything after the prompt: model turns as sampled and observations as tokenised once
    mask         True at the model's own tokens, False at observation tokens (a mask with holes)
    logprobs     the engine's sampling log-prob at model tokens, 0 at observation tokens

A model turn ends where the engine stopped (a stop token, or rollout.max_new_tokens) or, earlier, at the first
stop string (env.stop and the environment's own): the sampled tokens up to the one that completes the stop string
are kept, the rest are dropped with their log-probs. The environment gets the kept turn decoded (special tokens
included). An episode ends when the environment says done (the observation that comes with done is not appended),
after env.max_turns model turns (the last observation is not appended either: no model turn would follow it), or
when its tokens would pass env.max_episode_tokens: then it is cut there (a model turn at the limit, an observation
that does not fit is left out) and marked truncated, which is not an error.

Samples are seeded per turn from `sampling.seed`, and environment calls are collected in a fixed order, so the
same inputs, seed and environment give the same episodes bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch

from hpc_rlhf.envs.base import FLOAT32_MAX, EnvError, StepResult, check_observation, check_step, describe_row, one_line
from hpc_rlhf.envs.calls import CallOutcome, run_calls
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.loading import EnvFactory
from hpc_rlhf.envs.transcript import Transcript

log = logging.getLogger(__name__)

GenerateFn = Callable[[list[list[int]], Any], Any]
WaitingFn = Callable[[str], ContextManager]
_TURN_SEED_STRIDE = 1_000_003  # turn t of a batch seeded with seed * stride + t: distinct streams per turn


@dataclass
class Episode:
    """One played episode (see the module docstring for tokens, mask and logprobs)."""
    row_index: int
    sample_index: int
    prompt_ids: list[int]
    tokens: torch.Tensor                 # int64 [T]
    mask: torch.Tensor                   # bool [T]
    logprobs: torch.Tensor               # float32 [T]
    turn_rewards: list[float]
    turn_spans: list[tuple[int, int]]    # [start, end) of each model turn in `tokens`
    tool_calls: int
    done: bool                           # the environment ended it (not env.max_turns, the token limit or an error)
    truncated: bool                      # cut at env.max_episode_tokens
    env_time_s: float                    # time its environment calls took
    error: str | None = None             # env.on_error=skip: why it was dropped (its mask is all False)

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class EpisodeBatch:
    """The episodes of a batch, prompt-major (row i, sample j at i * n + j), and where the time went."""
    episodes: list[Episode]
    generate_calls: int
    generate_s: float
    env_s: float          # wall time spent waiting for environment calls
    wall_s: float

    def tokens(self) -> list[torch.Tensor]:
        return [e.tokens for e in self.episodes]

    def masks(self) -> list[torch.Tensor]:
        return [e.mask for e in self.episodes]

    def logprobs(self) -> list[torch.Tensor]:
        return [e.logprobs for e in self.episodes]

    def rewards(self) -> torch.Tensor:
        """The environment's reward of each episode (the sum of its turns' rewards), float32 [episodes]."""
        return torch.tensor([e.reward for e in self.episodes], dtype=torch.float32)

    def metric_sums(self) -> dict[str, float]:
        """Sums that add up over the shards of a step (one per rollout engine); `metrics_from_sums` turns their
        total into the step's metrics."""
        kept = [e for e in self.episodes if not e.failed]
        return {
            "episodes": float(len(self.episodes)),
            "episodes_kept": float(len(kept)),
            "turns": float(sum(e.turns for e in kept)),
            "tool_calls": float(sum(e.tool_calls for e in kept)),
            "episode_reward": float(sum(e.reward for e in kept)),
            "episode_tokens": float(sum(len(e.tokens) for e in kept)),
            "episodes_truncated": float(sum(e.truncated for e in self.episodes)),
            "episodes_failed": float(len(self.episodes) - len(kept)),
            "env_s": self.env_s,
            "wall_s": self.wall_s,
        }

    def metrics(self) -> dict[str, float]:
        return metrics_from_sums(self.metric_sums())


METRIC_SUMS = ("episodes", "episodes_kept", "turns", "tool_calls", "episode_reward", "episode_tokens",
               "episodes_truncated", "episodes_failed", "env_s", "wall_s")


def metrics_from_sums(sums: dict[str, float]) -> dict[str, float]:
    """Means over the episodes that were not dropped, counts over all of them, and the share of the rollout's
    wall time spent waiting for the environment."""
    kept = sums["episodes_kept"]

    def mean(key: str) -> float:
        return sums[key] / kept if kept else 0.0

    return {
        "turns_mean": mean("turns"),
        "tool_calls_mean": mean("tool_calls"),
        "episode_reward_mean": mean("episode_reward"),
        "episode_tokens_mean": mean("episode_tokens"),
        "episodes_truncated": sums["episodes_truncated"],
        "episodes_failed": sums["episodes_failed"],
        "env_time_share": sums["env_s"] / sums["wall_s"] if sums["wall_s"] > 0 else 0.0,
    }


@dataclass
class _State:
    """An episode while it is played."""
    row_index: int
    sample_index: int
    row: dict
    prompt_ids: list[int]
    where: str
    env: Any = None
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: int = 0
    done: bool = False
    truncated: bool = False
    ended: bool = False
    env_time_s: float = 0.0
    error: str | None = None

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.tokens.extend(ids)
        self.mask.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def finish(self) -> Episode:
        mask = torch.tensor(self.mask, dtype=torch.bool)
        if self.error is not None:
            mask = torch.zeros_like(mask)
        return Episode(self.row_index, self.sample_index, list(self.prompt_ids),
                       torch.tensor(self.tokens, dtype=torch.int64), mask,
                       torch.tensor(self.logprobs, dtype=torch.float32), list(self.turn_rewards),
                       list(self.turn_spans), self.tool_calls, self.done, self.truncated, self.env_time_s, self.error)


def cut_at_stop_strings(ids: Sequence[int], stop_strings: Sequence[str], decode: Callable[[list[int]], str]
                        ) -> int | None:
    """How many of `ids` to keep so that they end with the token that completes the first stop string (None when
    no stop string occurs). Found by bisection over decoded prefixes: a text that contains a stop string keeps
    containing it as tokens are added."""
    if not stop_strings or not any(s in decode(list(ids)) for s in stop_strings):
        return None
    low, high = 1, len(ids)  # the shortest prefix that contains a stop string is in [low, high]
    while low < high:
        middle = (low + high) // 2
        if any(s in decode(list(ids[:middle])) for s in stop_strings):
            high = middle
        else:
            low = middle + 1
    return low


def _as_lists(out: Any, count: int) -> tuple[list[list[int]], list[list[float]]]:
    """A generate call's result as plain lists: a RolloutBatch (flat_responses / flat_logprobs) or a pair of
    sequences (token ids, log-probs), one entry per prompt."""
    if hasattr(out, "flat_responses"):
        tokens, logprobs = out.flat_responses(), out.flat_logprobs()
    else:
        tokens, logprobs = out
    tokens = [t.tolist() if hasattr(t, "tolist") else list(t) for t in tokens]
    logprobs = [lp.tolist() if hasattr(lp, "tolist") else list(lp) for lp in logprobs]
    if len(tokens) != count or len(logprobs) != count:
        raise RuntimeError(f"generate returned {len(tokens)} responses and {len(logprobs)} log-prob rows for "
                           f"{count} prompts (one sample each)")
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        if len(t) != len(lp):
            raise RuntimeError(f"generate returned {len(t)} tokens but {len(lp)} log-probs for prompt {i}")
    return tokens, logprobs


class _Player:
    """Plays one batch of episodes (run_episodes is its only user)."""

    def __init__(self, env: EnvFactory, tokenizer, settings: EnvSection, transcript: Transcript,
                 waiting: WaitingFn | None = None):
        self.factory = env
        self.tokenizer = tokenizer
        self.settings = settings
        self.transcript = transcript
        self.waiting = waiting or (lambda what: contextlib.nullcontext())
        self.env_s = 0.0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def fail(self, state: _State, message: str) -> None:
        if self.settings.on_error == "fail":
            raise EnvError(message)
        log.warning("%s (env.on_error=skip: the episode is dropped)", message)
        state.error, state.ended = message, True

    def call_all(self, states: list[_State], calls: list[Callable[[], Any]]) -> list[CallOutcome]:
        begin = time.perf_counter()
        with self.waiting(f"environment {self.factory.name}"):  # named as the cause if the job dies meanwhile
            outcomes = run_calls(calls, self.settings.max_concurrency, self.factory.call_timeout_s)
        self.env_s += time.perf_counter() - begin
        for state, outcome in zip(states, outcomes):
            state.env_time_s += outcome.seconds
        return outcomes

    def problem(self, state: _State, method: str, outcome: CallOutcome) -> str | None:
        """The one-line message for a call that did not return normally, else None."""
        if outcome.timed_out:
            return f"{state.where}: {method} did not return within {self.factory.call_timeout_s:g} s"
        exc = outcome.error
        if exc is None:
            return None
        if isinstance(exc, EnvError):
            return f"{state.where}: {method} failed: {one_line(exc)}"
        return f"{state.where}: {method} raised {type(exc).__name__}: {one_line(exc)}"

    def reset(self, states: list[_State]) -> None:
        def reset_one(state: _State):
            def call():
                state.env = self.factory.make()  # constructed inside the call: its time and failures count too
                return state.env.reset(state.row)
            return call

        for state, outcome in zip(states, self.call_all(states, [reset_one(s) for s in states])):
            message = self.problem(state, "reset", outcome)
            if message is None:
                try:
                    observation = check_observation(outcome.value, "reset")
                except EnvError as exc:
                    message = f"{state.where}: {exc}"
            if message is not None:
                self.fail(state, message)
                continue
            self.append_observation(state, self.transcript.first_observation(observation))

    def append_observation(self, state: _State, ids: list[int]) -> None:
        """Append the observation's tokens, or end the episode as truncated when they leave no room for a turn."""
        if len(state.tokens) + len(ids) >= self.settings.max_episode_tokens:
            state.truncated = state.ended = True
            return
        state.append(ids, None)

    def take_turn(self, state: _State, ids: list[int], logprobs: list[float], stop_strings: Sequence[str]
                  ) -> str | None:
        """Append the model's turn (cut at a stop string and at the episode's token limit); its text, or None when
        the limit cut it (the episode then ends truncated, without a step)."""
        keep = cut_at_stop_strings(ids, stop_strings, self.decode)
        if keep is not None:
            ids, logprobs = ids[:keep], logprobs[:keep]
        room = self.settings.max_episode_tokens - len(state.tokens)
        cut = len(ids) > room
        if cut:
            ids, logprobs = ids[:room], logprobs[:room]
        start = len(state.tokens)
        state.append(ids, logprobs)
        state.turn_spans.append((start, len(state.tokens)))
        if cut:
            state.truncated = state.ended = True
            return None
        return self.decode(ids)

    def step(self, states: list[_State], actions: list[str], last_turn: bool) -> None:
        def step_one(state: _State, action: str):
            return lambda: state.env.step(action)

        outcomes = self.call_all(states, [step_one(s, a) for s, a in zip(states, actions)])
        for state, outcome in zip(states, outcomes):
            message = self.problem(state, "step", outcome)
            result: StepResult | None = None
            if message is None:
                try:
                    result = check_step(outcome.value)
                except EnvError as exc:
                    message = f"{state.where}: {exc}"
            if message is not None:
                self.fail(state, message)
                continue
            state.turn_rewards.append(result.reward)
            total = sum(state.turn_rewards) * self.settings.reward_weight
            if not abs(total) <= FLOAT32_MAX:  # each turn fits float32, but the weighted sum must too
                self.fail(state, f"{state.where}: the episode's reward so far times env.reward_weight is {total:.4g}, "
                                 f"not finite in float32 (|x| <= {FLOAT32_MAX:.4g})")
                continue
            state.tool_calls += result.tool_calls
            if result.done:
                state.done = state.ended = True
            elif last_turn:
                state.ended = True
            else:
                last = state.tokens[-1] if state.mask and state.mask[-1] else None
                self.append_observation(state, self.transcript.next_observation(result.observation, last))


def run_episodes(rows: Sequence[dict], prompt_ids: Sequence[Sequence[int]], generate: GenerateFn, sampling: Any, *,
                 env: EnvFactory, tokenizer, settings: EnvSection, chat: bool = False, lockstep: bool = False,
                 waiting: WaitingFn | None = None) -> EpisodeBatch:
    """Play `sampling.n` episodes for each of `rows` (whose prompts are `prompt_ids`), prompt-major.

    `generate(prompt id lists, sampling)` is called once per turn with every live episode's context (prompt and
    tokens so far) and `sampling` with n=1, max_new_tokens no more than any live episode has room for, and a seed
    for the turn when `sampling.seed` is set. `chat` says the prompts were made by `Transcript.prompt_ids` from chat
    data (observations then go through the chat template). With `lockstep`, generate is called for all
    env.max_turns turns even when no episode is left (with no prompts): ranks whose forward passes are collectives
    (a ZeRO-3 hybrid engine) must call it as often as each other. `waiting(what)`: a context manager that each
    turn's environment calls run in, told what they wait on (the RL recipe names it in the rank's watchdog phase).
    """
    if len(rows) != len(prompt_ids):
        raise ValueError(f"run_episodes: {len(rows)} rows but {len(prompt_ids)} prompts")
    if sampling.temperature == 0 and sampling.n > 1:  # the engines refuse it too; here each call has n=1
        raise ValueError(f"greedy decoding (temperature 0) gives n={sampling.n} identical episodes when the "
                         f"environment is deterministic; use n=1 or a temperature > 0")
    begin = time.perf_counter()
    transcript = Transcript(tokenizer, chat=chat, observation_role=settings.observation_role)
    player = _Player(env, tokenizer, settings, transcript, waiting)
    n = sampling.n
    states = [_State(i, j, row, list(ids), f"environment '{env.name}' on {describe_row(row, i)}"
                     + (f", sample {j}" if n > 1 else ""))
              for i, (row, ids) in enumerate(zip(rows, prompt_ids)) for j in range(n)]
    player.reset(states)
    generate_calls, generate_s = 0, 0.0
    for turn in range(settings.max_turns):
        live = [s for s in states if not s.ended]
        if not live and not lockstep:
            break
        room = max((settings.max_episode_tokens - len(s.tokens) for s in live), default=1)
        seed = None if sampling.seed is None else sampling.seed * _TURN_SEED_STRIDE + turn
        turn_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=min(sampling.max_new_tokens, room),
                                            seed=seed)
        started = time.perf_counter()
        out = generate([s.prompt_ids + s.tokens for s in live], turn_sampling)
        generate_s += time.perf_counter() - started
        generate_calls += 1
        tokens, logprobs = _as_lists(out, len(live))
        acting, actions = [], []
        for state, ids, lps in zip(live, tokens, logprobs):
            action = player.take_turn(state, ids, lps, env.stop_strings)
            if action is not None:
                acting.append(state)
                actions.append(action)
        player.step(acting, actions, last_turn=turn == settings.max_turns - 1)
    return EpisodeBatch([s.finish() for s in states], generate_calls, generate_s, player.env_s,
                        time.perf_counter() - begin)
