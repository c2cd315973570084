"""An environment behind HTTP (`env.http_url`), seen by the episode driver like any other environment.

    POST URL/reset  {"row": {...}, "turn": 0, "request_id": "..."}
                    -> {"episode_id": ..., "observation": "..."}
    POST URL/step   {"episode_id": ..., "action": "...", "turn": 1, "request_id": "..."}
                    -> {"observation": "...", "reward": 0.0, "done": false, "info": {...}}   (info optional)

`turn` counts the model's turns of the episode (0 for reset, 1 for the first step, ...); `request_id` is new for
every call and the same in all its tries. A call is tried again, up to `retries` more times with a short growing
pause, when the server cannot be reached, does not answer within `timeout_s` (a wall-clock deadline per try), or
answers 5xx. The server may have acted on a try whose answer was lost: a server that keeps its answers by request
id and answers a repeated id from there applies each reset and step once (examples/envs/http_server.py does), and
`turn` tells it a retry from the model sending the same action again. A 4xx answer, an answer past `max_bytes`, or
one that is not the JSON above fails at once: trying again would get the same.

Every message shows the URL as `shown_url` does (no credentials, no query); header values (`headers`, read from
environment variables by the loader) appear nowhere.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from hpc_rlhf.envs.base import EnvError, one_line
from hpc_rlhf.utils.http_post import HttpCallError, decode_json_object, post_json, shown_url, url_problem

MAX_BACKOFF_S = 5.0


class HttpEnvError(EnvError):
    """The HTTP environment could not be reached, timed out, or answered something unusable."""


class HttpEnvironment:
    """One episode of the environment at `url` (constructed per episode, like any environment)."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5,
                 max_reply_mb: float = 1.0, headers: Mapping[str, str] | None = None):
        problem = url_problem(url, "env.headers_from_env")
        if problem is not None:
            raise HttpEnvError(f"env.http_url {problem}")
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        # URL/reset and URL/step, the query (if any) kept after the path
        self.endpoints = {name: urlunsplit((parts.scheme, parts.netloc, f"{parts.path.rstrip('/')}/{name}",
                                            parts.query, "")) for name in ("reset", "step")}
        self.shown = shown_url(self.url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_bytes = int(max_reply_mb * 2 ** 20)
        self.headers = dict(headers or {})
        self.episode_id: Any = None
        self.turn = 0

    @staticmethod
    def longest_call_s(timeout_s: float, retries: int, backoff_s: float = 0.5) -> float:
        """The longest one call can take: every try running to its deadline, with the pauses between tries."""
        return (retries + 1) * timeout_s + sum(min(backoff_s * 2 ** k, MAX_BACKOFF_S) for k in range(retries))

    def reset(self, row: dict) -> str:
        self.turn = 0
        reply = self._post("reset", {"row": row, "turn": 0})
        for key in ("episode_id", "observation"):
            if key not in reply:
                raise HttpEnvError(f"POST {shown_url(self.endpoints['reset'])} answered without '{key}' "
                                   f"({one_line(json.dumps(reply), 80)})")
        self.episode_id = reply["episode_id"]
        return reply["observation"]

    def step(self, action: str) -> tuple[Any, Any, Any, Any]:
        if self.episode_id is None:
            raise HttpEnvError(f"step before reset for {self.shown}")
        self.turn += 1
        reply = self._post("step", {"episode_id": self.episode_id, "action": action, "turn": self.turn})
        for key in ("observation", "reward", "done"):
            if key not in reply:
                raise HttpEnvError(f"POST {shown_url(self.endpoints['step'])} answered without '{key}' "
                                   f"({one_line(json.dumps(reply), 80)})")
        return reply["observation"], reply["reward"], reply["done"], reply.get("info") or {}

    def _post(self, path: str, payload: dict) -> dict:
        url = self.endpoints[path]
        shown = shown_url(url)
        try:  # one request id for the call: its tries repeat it, so that the server can answer them from its cache
            body = json.dumps({**payload, "request_id": uuid.uuid4().hex}).encode()
        except (TypeError, ValueError) as exc:
            raise HttpEnvError(f"POST {shown}: the request cannot be sent as JSON: {exc}") from None
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                raw = post_json(url, body, timeout_s=self.timeout_s, max_bytes=self.max_bytes,
                                headers=self.headers, timeout_key="env.timeout_s", cap_key="env.max_reply_mb")
                return decode_json_object(raw)
            except HttpCallError as exc:
                if not exc.retry:
                    raise HttpEnvError(f"POST {shown} {exc}") from None
                last = str(exc)
        tries = self.retries + 1
        raise HttpEnvError(f"POST {shown} failed {tries} time{'s' if tries > 1 else ''}; last: {last}")
