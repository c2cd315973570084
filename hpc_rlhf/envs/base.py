"""What an environment is, and the checks on what it returns.

An environment is a class constructed with no arguments, once per episode:

    class MyEnv:
        def reset(self, row: dict) -> str: ...
            # the first observation, appended after the row's prompt ("" appends nothing)
        def step(self, action: str) -> tuple[str, float, bool] | tuple[str, float, bool, dict]: ...
            # (next observation, this turn's reward, whether the episode is done[, info])

`action` is the model's turn as text (decoded with its special tokens, e.g. a final `<eos>`); the token ids stay
as the model sampled them. `info` may carry `{"tool_calls": k}` (counted per episode). Subclassing `Environment`
is optional. A class may name strings that end the model's turn in a class attribute `stop_strings` (added to
env.stop).

Anything else an environment returns (a non-text observation, a reward that is not a finite number, a `done`
that is not true/false) is an error that names the environment, the episode's row and what was wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# torch.finfo(torch.float32).max: rewards are summed and trained on in float32, where a larger one is inf.
FLOAT32_MAX = 3.4028234663852886e38


class EnvError(ValueError):
    """An environment that cannot be loaded, failed, or returned something unusable (one line, naming it)."""


class Environment:
    """Optional base class: the two methods every environment has."""

    stop_strings: tuple[str, ...] = ()

    def reset(self, row: dict) -> str:
        raise NotImplementedError

    def step(self, action: str) -> tuple:
        raise NotImplementedError


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = field(default_factory=dict)

    @property
    def tool_calls(self) -> int:
        return int(self.info.get("tool_calls", 0))


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_row(row: Any, index: int | None = None) -> str:
    """A short name for an episode's row in messages: where it was read (`_source`, as load_rows sets it), or its
    position in the batch, and the beginning of its content."""
    where = row.get("_source") if isinstance(row, dict) else None
    if where is None:
        where = f"row {index}" if index is not None else "row"
    shown = {k: v for k, v in row.items() if not str(k).startswith("_")} if isinstance(row, dict) else row
    return f"{where} {one_line(repr(shown), 80)}"


def check_observation(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise EnvError(f"{what} returned an observation of type {type(value).__name__} ({one_line(repr(value), 60)})"
                       f"; observations must be text (str)")
    return value


def check_step(value: Any) -> StepResult:
    """The step's (observation, reward, done[, info]) checked; EnvError says what is wrong (the caller names the
    environment and the row)."""
    if not isinstance(value, (tuple, list)) or len(value) not in (3, 4):
        raise EnvError(f"step returned {one_line(repr(value), 60)}; it must return (observation, reward, done) or "
                       f"(observation, reward, done, info)")
    observation, reward, done = value[:3]
    info = value[3] if len(value) == 4 else {}
    check_observation(observation, "step")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not _is_number(reward):
        raise EnvError(f"step returned reward {one_line(repr(reward), 60)} ({type(reward).__name__}); rewards must "
                       f"be numbers")
    try:
        reward = float(reward)
    except OverflowError:  # an integer past float's range (a JSON reply may carry one)
        raise EnvError(f"step returned reward {one_line(repr(reward), 40)}, too large for a float; rewards must "
                       f"be finite") from None
    if not math.isfinite(reward):
        raise EnvError(f"step returned reward {reward}; rewards must be finite")
    if abs(reward) > FLOAT32_MAX:
        raise EnvError(f"step returned reward {reward}, past float32's range (|reward| <= {FLOAT32_MAX:.4g}) in "
                       f"which rewards are trained")
    if not (isinstance(done, bool) or _is_bool(done)):
        raise EnvError(f"step returned done={one_line(repr(done), 60)} ({type(done).__name__}); done must be true "
                       f"or false")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise EnvError(f"step returned info of type {type(info).__name__}; info must be a dict")
    calls = info.get("tool_calls", 0)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
        raise EnvError(f"step returned info['tool_calls']={one_line(repr(calls), 40)}; it must be a count (an "
                       f"integer >= 0)")
    return StepResult(observation, reward, bool(done), info)


def _is_number(value: Any) -> bool:
    # numpy and torch scalars: a 0-d value that converts to float
    return getattr(value, "shape", None) == () and hasattr(value, "__float__") and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    return getattr(value, "dtype", None) is not None and str(value.dtype) in ("bool", "torch.bool") \
        and getattr(value, "shape", None) == ()
