"""A reference server for HTTP environments (`env.http_url`): any environment class, served over the protocol of
hpc_rlhf/envs/http.py (docs/agents.md, "Environments over HTTP"), with retries made safe. Standard library only.

    python examples/envs/http_server.py --env examples/envs/digit_hint.py:DigitHint --port 8000
    hpc-rlhf grpo --config examples/tiny/grpo.yaml env.http_url=http://127.0.0.1:8000 env.max_turns=2 \
        reward.functions=[] placement=actor+ref=1,rollout@actor

The client repeats a call whose answer it did not get (a try past env.timeout_s, a 5xx, a broken connection),
with the same `request_id`. The server may have acted on the first try already, so it keeps every answer by
request id and answers a repeated id from there, waiting for the first try to finish when it is still running:
each reset and step is applied once, and an episode's rewards are the same as if nothing had been repeated. A
step also carries its `turn` (1, 2, ... within the episode): a step whose turn is not the next one (sent again
under a new request id, or out of order) is refused with 409, never applied twice.

An environment that raises is answered 500 with the error, and that answer is kept too: applying a half-done
step again could do its side effects twice.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import threading
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

MAX_REQUEST_BYTES = 4 * 2 ** 20   # a request body larger than this is refused (413)
KEPT_ANSWERS = 100_000            # answers kept for repeated request ids (the oldest finished ones go first)
KEPT_EPISODES = 100_000           # episodes kept (the least recently used go first; a done one goes at once)


class _Answer:
    """The answer to one request id, once it is known."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.status, self.payload = 500, {}


class _Episode:
    def __init__(self, env: Any):
        self.env, self.turn, self.lock = env, 0, threading.Lock()


class EnvServer:
    """The protocol without the sockets: `handle(path, body) -> (status, payload)`. `make_env()` makes one
    environment per episode (a class with reset(row) -> str and step(action) -> (observation, reward, done[, info]))."""

    def __init__(self, make_env: Callable[[], Any]):
        self.make_env = make_env
        self.lock = threading.Lock()
        self.answers: OrderedDict[str, _Answer] = OrderedDict()
        self.episodes: OrderedDict[str, _Episode] = OrderedDict()
        self.repeats = 0  # requests answered from the kept answers

    def handle(self, path: str, body: Any) -> tuple[int, dict]:
        if path not in ("/reset", "/step"):
            return 404, {"error": f"no endpoint {path}: POST /reset or /step"}
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str) or not body["request_id"]:
            return 400, {"error": "the request must be a JSON object with a request_id (a non-empty string)"}
        request_id = body["request_id"]
        with self.lock:
            answer = self.answers.get(request_id)
            first = answer is None
            if first:
                answer = self.answers[request_id] = _Answer()
                self._forget_old_answers()
            else:
                self.repeats += 1
        if not first:
            answer.ready.wait()  # a repeat of a request still being worked on gets the first try's answer
            return answer.status, answer.payload
        try:
            answer.status, answer.payload = self._reset(body) if path == "/reset" else self._step(body)
        except Exception as exc:  # noqa: BLE001 - the environment's error goes to the client, kept like any answer
            answer.status, answer.payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            answer.ready.set()
        return answer.status, answer.payload

    def _reset(self, body: dict) -> tuple[int, dict]:
        row = body.get("row")
        if not isinstance(row, dict):
            return 400, {"error": "reset needs a row (a JSON object)"}
        episode = _Episode(self.make_env())
        observation = episode.env.reset(row)
        episode_id = uuid.uuid4().hex
        with self.lock:
            self.episodes[episode_id] = episode
            while len(self.episodes) > KEPT_EPISODES:
                self.episodes.popitem(last=False)
        return 200, {"episode_id": episode_id, "observation": observation}

    def _step(self, body: dict) -> tuple[int, dict]:
        episode_id, turn, action = body.get("episode_id"), body.get("turn"), body.get("action")
        if not isinstance(action, str) or not isinstance(turn, int) or isinstance(turn, bool):
            return 400, {"error": "step needs an action (a string) and a turn (an integer)"}
        with self.lock:
            episode = self.episodes.get(episode_id) if isinstance(episode_id, str) else None
            if episode is not None:
                self.episodes.move_to_end(episode_id)
        if episode is None:
            return 404, {"error": f"no episode {episode_id!r} (never started, done, or forgotten)"}
        with episode.lock:
            if turn != episode.turn + 1:
                return 409, {"error": f"episode {episode_id}: turn {turn} is not the next one ({episode.turn + 1}); "
                                      f"a step is applied once"}
            result = episode.env.step(action)
            episode.turn = turn
        observation, reward, done = result[:3]
        info = result[3] if len(result) > 3 else {}
        if done:
            with self.lock:
                self.episodes.pop(episode_id, None)
        return 200, {"observation": observation, "reward": reward, "done": bool(done), "info": info or {}}

    def _forget_old_answers(self) -> None:
        """Keep KEPT_ANSWERS answers at most, dropping the oldest finished ones (called holding the lock)."""
        while len(self.answers) > KEPT_ANSWERS:
            oldest_id, oldest = next(iter(self.answers.items()))
            if not oldest.ready.is_set():
                break  # still being worked on: its repeats must find it
            del self.answers[oldest_id]


def serve(make_env: Callable[[], Any], host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, EnvServer]:
    """Start serving in a background thread; (the HTTP server, the protocol). Port 0: one the OS picks
    (`server.server_address[1]`). Stop with `server.shutdown(); server.server_close()`."""
    protocol = EnvServer(make_env)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self.answer(411, {"error": "a Content-Length is needed"})
            if length > MAX_REQUEST_BYTES:
                return self.answer(413, {"error": f"the request is over {MAX_REQUEST_BYTES} bytes"})
            try:
                body = json.loads(self.rfile.read(length))
            except (ValueError, RecursionError):
                return self.answer(400, {"error": "the request is not JSON"})
            self.answer(*protocol.handle(self.path, body))

        def answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on this try; its repeat is answered from the kept answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, protocol


def load_class(spec: str) -> type:
    """`path/to/file.py:Class` or `package.module:Class`."""
    target, _, name = spec.rpartition(":")
    if not target:
        raise SystemExit(f"--env {spec!r} must look like path/to/file.py:Class or package.module:Class")
    if target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(Path(target).stem, target)
        if module_spec is None or not Path(target).is_file():
            raise SystemExit(f"--env {spec!r}: {target} is not a file")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise SystemExit(f"--env {spec!r}: {target} has no class {name}")
    return cls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default=str(Path(__file__).with_name("digit_hint.py")) + ":DigitHint",
                        help="the environment class (default: the DigitHint example)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server, _ = serve(load_class(args.env), args.host, args.port)
    print(f"serving {args.env} on http://{args.host}:{server.server_address[1]} (Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
