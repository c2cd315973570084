"""The `env` section of the RL config: which environment the model acts in, and the limits of an episode."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlhf.config import ConfigError, field
from hpc_rlhf.utils.http_post import header_mapping_problem, shown_url, url_problem


@dataclass
class EnvSection:
    """Multi-turn episodes: an environment answers each turn of the model (off unless env.name or env.http_url)."""
    name: str | None = field(None, help="environment class: path/to/file.py:Class, package.module:Class or a "
                                        "built-in (calculator, guess_number)")
    http_url: str | None = field(None, help="environment behind HTTP: POST URL/reset and URL/step (JSON); http:// or "
                                            "https://, no credentials in it (user:password@, ?token=...: use "
                                            "env.headers_from_env)")
    headers_from_env: dict[str, str] = field({}, help="HTTP: headers sent with every call, as header name -> the "
                                                      "environment variable holding its value (e.g. {Authorization: "
                                                      "ENV_TOKEN}); values never reach logs or config.yaml")
    max_reply_mb: float = field(1.0, help="HTTP: the largest answer body accepted, in MiB (a longer one fails the "
                                          "call)")
    max_turns: int = field(4, min=1, help="model turns per episode at most")
    max_episode_tokens: int = field(64, min=1, help="tokens of an episode after its prompt, observations included; "
                                                    "a longer episode is cut there and counted as truncated")
    max_concurrency: int = field(16, min=1, help="environment calls of one turn that run at the same time")
    timeout_s: float = field(60.0, min=0, help="seconds one environment call may take (over HTTP: one try, a "
                                               "wall-clock deadline)")
    retries: int = field(2, min=0, help="HTTP: tries after a failed one (down, slow, 5xx), per call")
    on_error: str = field("fail", choices=["fail", "skip"],
                          help="a failing environment ends the job, or only its episode (counted as failed)")
    reward_weight: float = field(1.0, help="weight of the environment's reward (the sum of its turns' rewards) "
                                           "among the other rewards")
    observation_role: str = field("tool", help="chat data: the role of the environment's messages")
    stop: list[str] = field([], help="strings that end the model's turn (kept; what follows is dropped)")

    @property
    def enabled(self) -> bool:
        return bool(self.name or self.http_url)

    def validate(self) -> None:
        if self.name and self.http_url:
            raise ConfigError(f"env.name={self.name!r} and env.http_url={shown_url(self.http_url)!r} are both set; an "
                              f"episode runs in one environment: keep one of them")
        problem = None if self.http_url is None else url_problem(self.http_url, "env.headers_from_env")
        if problem is not None:
            raise ConfigError(f"env.http_url {problem}")
        if self.max_reply_mb <= 0:
            raise ConfigError(f"env.max_reply_mb must be > 0, got {self.max_reply_mb}")
        problem = header_mapping_problem(self.headers_from_env, "env.headers_from_env")
        if problem is not None:
            raise ConfigError(problem)
        if self.headers_from_env and not self.http_url:
            raise ConfigError("env.headers_from_env is set but env.http_url is not: the headers go with HTTP calls")
        if self.timeout_s <= 0:
            raise ConfigError(f"env.timeout_s must be > 0, got {self.timeout_s}")
        if any(not s for s in self.stop):
            raise ConfigError(f"env.stop has an empty string ({self.stop}); every stop string needs a character")
        if not self.observation_role:
            raise ConfigError("env.observation_role must name a chat role (e.g. tool or user)")
