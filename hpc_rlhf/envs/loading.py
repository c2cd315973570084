"""Finding the environment a config names: `path/to/file.py:Class`, `package.module:Class`, a built-in name, or an
HTTP endpoint. The result, an `EnvFactory`, makes one environment per episode and knows what to call it in
messages and how long one of its calls may take.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from hpc_rlhf.envs.base import EnvError
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.http import HttpEnvironment
from hpc_rlhf.utils.http_post import headers_from_env, shown_url
from hpc_rlhf.utils.imports import ModuleFileMissing, import_target

# The HTTP client ends every call by itself within HttpEnvironment.longest_call_s; the driver's own bound on the
# call (run_calls) comes this much later, so that the client's error, which says what the server did, is the one
# reported.
HTTP_CALL_MARGIN_S = 1.0

# Built-in environments of the tiny task, by short name.
BUILTIN = {
    "calculator": "hpc_rlhf.envs.calculator:Calculator",
    "guess_number": "hpc_rlhf.envs.guess_number:GuessNumber",
}


@dataclass(frozen=True)
class EnvFactory:
    """`make()` gives a new environment for one episode. `name` is what messages call the environment,
    `stop_strings` end the model's turn (env.stop and the class's own), `call_timeout_s` bounds one call."""
    name: str
    make: Callable[[], Any]
    stop_strings: tuple[str, ...] = ()
    call_timeout_s: float = 60.0


def load_environment_class(spec: str) -> type:
    """The class `spec` names (`file.py:Class`, `package.module:Class` or a built-in name), checked to have
    `reset` and `step`; EnvError (one line, naming `spec`) otherwise."""
    target_spec = BUILTIN.get(spec, spec)
    if ":" not in target_spec:
        raise EnvError(f"environment '{spec}' must look like path/to/file.py:Class or package.module:Class "
                       f"(built-ins: {', '.join(BUILTIN)})")
    target, name = target_spec.rsplit(":", 1)
    try:
        module = import_target(target, "hpc_rlhf_env_")
    except ModuleFileMissing as exc:
        raise EnvError(f"environment '{spec}': {exc}") from None
    except Exception as exc:  # the user's module failed to import: say which and why
        raise EnvError(f"environment '{spec}': importing {target} failed: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, name, None)
    if cls is None:
        raise EnvError(f"environment '{spec}': {target} has no '{name}'")
    if not isinstance(cls, type):
        raise EnvError(f"environment '{spec}': '{name}' is a {type(cls).__name__}, not a class (an environment is "
                       f"a class constructed once per episode)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"environment '{spec}': class {name} has no {' or '.join(missing)} method "
                       f"(it needs reset(row) -> str and step(action) -> (observation, reward, done))")
    return cls


def _check_stop_strings(stops: Any, where: str) -> tuple[str, ...]:
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise EnvError(f"{where}: stop_strings must be a list of non-empty strings, got {stops!r}")
    return tuple(stops)


def http_call_bound_s(section: EnvSection) -> float:
    """How long the episode driver waits for one call of an HTTP environment before giving it up."""
    return HttpEnvironment.longest_call_s(section.timeout_s, section.retries) + HTTP_CALL_MARGIN_S


def episode_bound_s(section: EnvSection) -> float:
    """The longest one episode's environment calls can take: reset and env.max_turns steps, each call at its
    bound (over HTTP every try to its deadline, with the retries' pauses). Generation time is not included."""
    per_call = http_call_bound_s(section) if section.http_url else section.timeout_s
    return (section.max_turns + 1) * per_call


def load_environment(section: EnvSection) -> EnvFactory:
    """The environment of `section` (env.name or env.http_url) as a factory of one environment per episode."""
    if section.http_url:
        try:  # read here, on the rank that calls the server: the values stay in this process
            headers = headers_from_env(section.headers_from_env, "env.headers_from_env")
        except ValueError as exc:
            raise EnvError(str(exc)) from None
        make = functools.partial(HttpEnvironment, section.http_url, timeout_s=section.timeout_s,
                                 retries=section.retries, max_reply_mb=section.max_reply_mb, headers=headers)
        make()  # a bad URL fails here, at start-up, rather than in every episode
        return EnvFactory(name=shown_url(section.http_url), make=make, stop_strings=tuple(section.stop),
                          call_timeout_s=http_call_bound_s(section))
    if not section.name:
        raise EnvError("no environment: set env.name (a class) or env.http_url")
    cls = load_environment_class(section.name)
    own = _check_stop_strings(getattr(cls, "stop_strings", ()), f"environment '{section.name}'")
    stops = tuple(dict.fromkeys([*section.stop, *own]))  # in order, without repeats
    return EnvFactory(name=section.name, make=cls, stop_strings=stops, call_timeout_s=section.timeout_s)
