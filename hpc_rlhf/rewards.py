"""Rule and remote reward functions for the RL modes.

A reward function is given in the config as `path/to/file.py:function` or `package.module:function` and is
called on batches:

    def my_reward(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]

`prompts` are the prompt texts, `responses` the decoded responses (special tokens such as the end-of-sequence
text included, so a function can require a proper ending), `answers` the data set's reference answers
(`data.answer_key`; None for rows without one). It returns one finite float per response (a list, tuple, or
1-D tensor). Anything else stops the run with a message naming the function.

An HTTP endpoint (`reward.http_url`) receives `{"prompts": [...], "responses": [...], "answers": [...],
"request_id": "..."}` as a JSON POST and answers `{"rewards": [...]}`. Each try has a wall-clock deadline
(`reward.http_timeout_s`) and a cap on the reply's size (`reward.http_max_reply_mb`); a failed try is repeated (3
tries in all, with the same request id) when the endpoint could not be reached, was too slow or answered 5xx.
Scoring the same batch twice must be harmless (a reward endpoint should have no side effects).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from hpc_rlhf.data.synthetic import exact_match as _exact_match
from hpc_rlhf.utils.http_post import HttpCallError, decode_json_object, post_json, shown_url, url_problem
from hpc_rlhf.utils.imports import ModuleFileMissing, import_target

if TYPE_CHECKING:
    import torch

RewardFn = Callable[[list, list, list], Sequence[float]]
# float32's largest value (torch.finfo(torch.float32).max): rewards are combined and trained on in float32. Written
# out, so that the command line (`hpc-rlhf plan` on a login node) imports no torch through this module.
FLOAT32_MAX = 3.4028234663852886e38
HTTP_TRIES = 3          # tries of a remote reward call in all
MAX_BACKOFF_S = 10.0    # the longest pause between two of them


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
    """The returned rewards as floats, or a clear error naming the function and what was wrong. Each must be finite
    in float32, the precision rewards are combined and trained in (1e39 is finite in float64 and inf there)."""
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
            raise RewardFunctionError(f"{what} returned {_short(v)} ({type(v).__name__}) for response {i}; "
                                      f"rewards must be numbers")
        try:
            value = float(v)
        except OverflowError:  # an int past float's range (a JSON reply may carry one)
            value = math.inf
        if not math.isfinite(v if isinstance(v, float) else value):
            raise RewardFunctionError(f"{what} returned {_short(v)} for response {i}; rewards must be finite")
        if abs(value) > FLOAT32_MAX:
            raise RewardFunctionError(f"{what} returned {_short(v)} for response {i}, past float32's range "
                                      f"(|reward| <= {FLOAT32_MAX:.4g}) in which rewards are trained")
        out.append(value)
    return out


def check_weighted(total: torch.Tensor, what: str) -> torch.Tensor:
    """`total` (float32 rewards after weighting) unchanged when every value is finite, else an error naming `what`
    and the first sample that is not: a weight can push a finite reward past float32's range."""
    bad = (~total.isfinite()).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RewardFunctionError(f"{what} gave response {i} the reward {float(total[i])} after weighting; rewards "
                                  f"must be finite in float32 (check the weight and the values it returns)")
    return total


def call_reward_function(fn: RewardFn, spec: str, prompts: list[str], responses: list[str],
                         answers: list[str | None]) -> list[float]:
    try:
        values = fn(prompts, responses, answers)
    except Exception as exc:
        raise RewardFunctionError(f"reward function '{spec}' raised {type(exc).__name__}: {exc}") from exc
    return check_rewards(values, len(responses), f"reward function '{spec}'")


def remote_rewards(url: str, prompts: list[str], responses: list[str], answers: list[str | None],
                   timeout_s: float = 60.0, retries: int = HTTP_TRIES, max_reply_mb: float = 16.0,
                   headers: Mapping[str, str] | None = None) -> list[float]:
    """The endpoint's rewards, in `retries` tries at most, each with a wall-clock deadline of `timeout_s` and a
    reply of `max_reply_mb` at most. Every failure is one RewardFunctionError naming the URL (as `shown_url`
    shows it: no credentials, no query) and the cause."""
    shown = shown_url(url)
    problem = url_problem(url, "reward.http_headers_from_env")
    if problem is not None:
        raise RewardFunctionError(f"reward.http_url {problem}")
    # one request id for the call, repeated by its tries: an endpoint can tell a retry from a new batch
    body = json.dumps({"prompts": prompts, "responses": responses, "answers": answers,
                       "request_id": uuid.uuid4().hex}).encode()
    last = ""
    for attempt in range(retries):
        if attempt:
            time.sleep(backoff_s(attempt))
        try:
            raw = post_json(url, body, timeout_s=timeout_s, max_bytes=int(max_reply_mb * 2 ** 20), headers=headers,
                            timeout_key="reward.http_timeout_s", cap_key="reward.http_max_reply_mb")
            payload = decode_json_object(raw)
        except HttpCallError as exc:
            if not exc.retry:
                raise RewardFunctionError(f"reward endpoint {shown} {exc}") from None
            last = str(exc)
            continue
        if "rewards" not in payload:
            raise RewardFunctionError(f"reward endpoint {shown} answered without a 'rewards' list")
        return check_rewards(payload["rewards"], len(responses), f"reward endpoint {shown}")
    raise RewardFunctionError(f"reward endpoint {shown} failed {retries} time{'s' if retries > 1 else ''}; "
                              f"last: {last}")


def backoff_s(attempt: int) -> float:
    """The pause before try `attempt` + 1 (attempt >= 1) of the remote reward call."""
    return float(min(2 ** (attempt - 1), MAX_BACKOFF_S))


def longest_remote_call_s(timeout_s: float, retries: int = HTTP_TRIES) -> float:
    """The longest one remote reward call can take: every try to its deadline, with the pauses between them."""
    return retries * timeout_s + sum(backoff_s(a) for a in range(1, retries))


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
