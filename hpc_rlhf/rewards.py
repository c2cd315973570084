"""Rule and remote reward functions for the RL modes.

A reward function is given in the config as `path/to/file.py:function` or `package.module:function` and is
called on batches:

    def my_reward(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]

`prompts` are the prompt texts, `responses` the decoded responses (special tokens such as the end-of-sequence
text included, so a function can require a proper ending), `answers` the data set's reference answers
(`data.answer_key`; None for rows without one). It returns one finite float per response (a list, tuple, or
1-D tensor). Anything else stops the run with a message naming the function.

An HTTP endpoint (`reward.http_url`) receives `{"prompts": [...], "responses": [...], "answers": [...]}` as a
JSON POST and answers `{"rewards": [...]}`; it is called with a timeout and a few retries.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Callable, Sequence

from hpc_rlhf.data.synthetic import exact_match as _exact_match
from hpc_rlhf.utils.imports import ModuleFileMissing, import_target

RewardFn = Callable[[list, list, list], Sequence[float]]


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded or that returned something unusable."""


def exact_match(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """Built-in rule reward of the tiny task: 1 when the response is exactly the reference answer."""
    return [0.0 if answer is None else _exact_match(response, answer) for response, answer in zip(responses, answers)]


BUILTIN = {"exact_match": exact_match}


def load_reward_function(spec: str) -> RewardFn:
    """`file.py:function`, `package.module:function`, or a built-in name (`exact_match`)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise RewardFunctionError(f"reward function '{spec}' must look like path/to/file.py:function or "
                                  f"package.module:function (built-ins: {', '.join(BUILTIN)})")
    target, name = spec.rsplit(":", 1)
    try:
        module = import_target(target, "hpc_rlhf_reward_")
    except ModuleFileMissing as exc:
        raise RewardFunctionError(f"reward function '{spec}': {exc}") from None
    except Exception as exc:  # the user's module failed to import: say which and why
        raise RewardFunctionError(f"reward function '{spec}': importing {target} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise RewardFunctionError(f"reward function '{spec}': {target} has no callable '{name}'")
    return fn


def check_rewards(values, count: int, what: str) -> list[float]:
    """The returned rewards as floats, or a clear error naming the function and what was wrong."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(f"{what} returned {type(values).__name__}; it must return a list of "
                                  f"{count} floats")
    if len(values) != count:
        raise RewardFunctionError(f"{what} returned {len(values)} rewards for {count} responses")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RewardFunctionError(f"{what} returned {v!r} ({type(v).__name__}) for response {i}; "
                                      f"rewards must be numbers")
        if not math.isfinite(v):
            raise RewardFunctionError(f"{what} returned {v} for response {i}; rewards must be finite")
        out.append(float(v))
    return out


def call_reward_function(fn: RewardFn, spec: str, prompts: list[str], responses: list[str],
                         answers: list[str | None]) -> list[float]:
    try:
        values = fn(prompts, responses, answers)
    except Exception as exc:
        raise RewardFunctionError(f"reward function '{spec}' raised {type(exc).__name__}: {exc}") from exc
    return check_rewards(values, len(responses), f"reward function '{spec}'")


def remote_rewards(url: str, prompts: list[str], responses: list[str], answers: list[str | None],
                   timeout_s: float = 60.0, retries: int = 3) -> list[float]:
    body = json.dumps({"prompts": prompts, "responses": responses, "answers": answers}).encode()
    last = None
    for attempt in range(retries):
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                payload = json.loads(reply.read())
            if not isinstance(payload, dict) or "rewards" not in payload:
                raise RewardFunctionError(f"reward endpoint {url} answered without a 'rewards' list")
            return check_rewards(payload["rewards"], len(responses), f"reward endpoint {url}")
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
            last = exc
            time.sleep(min(2 ** attempt, 10))
    raise RewardFunctionError(f"reward endpoint {url} failed {retries} times; last error: {last}")
