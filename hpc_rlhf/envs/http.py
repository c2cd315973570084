"""An environment behind HTTP (`env.http_url`), seen by the episode driver like any other environment.

    POST URL/reset  {"row": {...}}                        -> {"episode_id": ..., "observation": "..."}
    POST URL/step   {"episode_id": ..., "action": "..."}  -> {"observation": "...", "reward": 0.0, "done": false,
                                                              "info": {...}}   (info optional)

Each POST has a timeout (`timeout_s`, per try) and is tried again, up to `retries` more times with a short
growing pause, when the server cannot be reached, does not answer in time, or answers 5xx. A 4xx answer or a
reply that is not the JSON above fails at once: trying again would get the same. A server should make /step
safe to repeat for an episode (a step whose reply was lost is sent again).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from hpc_rlhf.envs.base import EnvError, one_line


class HttpEnvError(EnvError):
    """The HTTP environment could not be reached, timed out, or answered something unusable."""


class HttpEnvironment:
    """One episode of the environment at `url` (constructed per episode, like any environment)."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.episode_id: Any = None

    @staticmethod
    def longest_call_s(timeout_s: float, retries: int, backoff_s: float = 0.5) -> float:
        """The longest one call can take: every try timing out, with the pauses between tries."""
        return (retries + 1) * timeout_s + sum(min(backoff_s * 2 ** k, 5.0) for k in range(retries))

    def reset(self, row: dict) -> str:
        reply = self._post("reset", {"row": row})
        for key in ("episode_id", "observation"):
            if key not in reply:
                raise HttpEnvError(f"POST {self.url}/reset answered without '{key}' "
                                   f"({one_line(json.dumps(reply), 80)})")
        self.episode_id = reply["episode_id"]
        return reply["observation"]

    def step(self, action: str) -> tuple[Any, Any, Any, Any]:
        if self.episode_id is None:
            raise HttpEnvError(f"step before reset for {self.url}")
        reply = self._post("step", {"episode_id": self.episode_id, "action": action})
        for key in ("observation", "reward", "done"):
            if key not in reply:
                raise HttpEnvError(f"POST {self.url}/step answered without '{key}' "
                                   f"({one_line(json.dumps(reply), 80)})")
        return reply["observation"], reply["reward"], reply["done"], reply.get("info") or {}

    def _post(self, path: str, payload: dict) -> dict:
        url = f"{self.url}/{path}"
        try:
            body = json.dumps(payload).encode()
        except (TypeError, ValueError) as exc:
            raise HttpEnvError(f"POST {url}: the request cannot be sent as JSON: {exc}") from None
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 5.0))
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    raw = reply.read()
            except urllib.error.HTTPError as exc:
                detail = one_line(exc.read().decode(errors="replace"), 120)
                last = f"HTTP {exc.code} {exc.reason}: {detail}" if detail else f"HTTP {exc.code} {exc.reason}"
                if exc.code < 500:
                    raise HttpEnvError(f"POST {url} answered {last}") from None
                continue
            except (TimeoutError, socket.timeout):
                last = f"no answer within {self.timeout_s:g} s"
                continue
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                    last = f"no answer within {self.timeout_s:g} s"
                else:
                    last = f"cannot reach it ({exc.reason})"
                continue
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            try:
                decoded = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise HttpEnvError(f"POST {url} answered something that is not JSON: "
                                   f"{one_line(raw.decode(errors='replace'), 80)}") from None
            if not isinstance(decoded, dict):
                raise HttpEnvError(f"POST {url} answered {one_line(json.dumps(decoded), 60)}; a JSON object was "
                                   f"expected")
            return decoded
        tries = self.retries + 1
        raise HttpEnvError(f"POST {url} failed {tries} time{'s' if tries > 1 else ''}; last: {last}")
