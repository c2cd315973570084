"""The HTTP environment client against a small server started here: normal episodes, a server that is down, one
that is slow (timeout), one that fails now and then (retries), and answers that are not what the protocol says."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.envs.base import EnvError
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.episodes import run_episodes
from hpc_rlhf.envs.http import HttpEnvError, HttpEnvironment
from hpc_rlhf.config import ConfigError
from hpc_rlhf.envs.loading import HTTP_CALL_MARGIN_S, episode_bound_s, load_environment
from tests.envs.conftest import Scripted


class Server:
    """A counting game over HTTP: reset answers "count:", each step is rewarded 1 when the action is the
    number of steps so far, and the episode is done after two steps. `script` bends the behaviour."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.episodes: dict[str, int] = {}
        self.failures_left = 0      # answer 503 to this many requests first
        self.delay_s = 0.0          # wait before answering
        self.reply: dict | None = None  # answer this instead
        self.reply_step: dict | None = None  # answer this to /step instead
        self.status = 200
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.path = self.path.split("?")[0]  # a query in env.http_url travels with each call
                server.requests.append((self.path, body))
                time.sleep(server.delay_s)
                if server.failures_left:
                    server.failures_left -= 1
                    return self.answer(503, {"error": "busy"})
                if server.status != 200:
                    return self.answer(server.status, {"error": "no such episode"})
                if server.reply is not None:
                    return self.answer(200, server.reply)
                if server.reply_step is not None and self.path == "/step":
                    return self.answer(200, server.reply_step)
                if self.path == "/reset":
                    episode = f"e{len(server.episodes)}"
                    server.episodes[episode] = 0
                    return self.answer(200, {"episode_id": episode, "observation": f"count {body['row']['n']}:"})
                server.episodes[body["episode_id"]] += 1
                steps = server.episodes[body["episode_id"]]
                reward = 1.0 if body["action"].strip() == str(steps) else 0.0
                self.answer(200, {"observation": f" {steps} ", "reward": reward, "done": steps == 2,
                                  "info": {"tool_calls": 1}})

            def answer(self, status, payload):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: shutdown() waits for the next one (0.5 s by default)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture()
def server():
    s = Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_episode_over_http(server):
    env = HttpEnvironment(server.url, timeout_s=5)
    assert env.reset({"n": 3}) == "count 3:"
    assert env.step("1") == (" 1 ", 1.0, False, {"tool_calls": 1})
    assert env.step("5") == (" 2 ", 0.0, True, {"tool_calls": 1})
    ids = [body.pop("request_id") for _, body in server.requests]
    assert len(set(ids)) == 3 and all(isinstance(i, str) and len(i) >= 16 for i in ids)  # one per call
    assert server.requests == [("/reset", {"row": {"n": 3}, "turn": 0}),
                               ("/step", {"episode_id": "e0", "action": "1", "turn": 1}),
                               ("/step", {"episode_id": "e0", "action": "5", "turn": 2})]


def test_the_driver_plays_http_episodes_through_load_environment(server, tokenizer):
    section = EnvSection(http_url=server.url + "/", max_turns=4, max_episode_tokens=64, timeout_s=5)
    factory = load_environment(section)
    rows = [{"prompt": "a", "n": i} for i in range(3)]
    batch = run_episodes(rows, [[1, 40]] * 3, Scripted(tokenizer, ["1", "2", "3"]), SamplingParams(max_new_tokens=4),
                         env=factory, tokenizer=tokenizer, settings=section)
    assert [e.turn_rewards for e in batch.episodes] == [[1.0, 1.0]] * 3
    assert all(e.done and e.turns == 2 and e.tool_calls == 2 for e in batch.episodes)
    assert len(server.episodes) == 3  # one server episode per driver episode
    first = batch.episodes[0]
    assert tokenizer.decode(first.tokens.tolist()) == "count 0:1 1 2"


def test_a_server_that_is_down_fails_after_the_retries(tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    env = HttpEnvironment(url, timeout_s=1, retries=2, backoff_s=0.01)
    started = time.perf_counter()
    with pytest.raises(HttpEnvError, match=rf"POST {url}/reset failed 3 times; last: cannot reach it \(.*refused"):
        env.reset({})
    assert time.perf_counter() - started < 1
    section = EnvSection(http_url=url, retries=0, timeout_s=1)
    with pytest.raises(EnvError) as caught:
        run_episodes([{"prompt": "a"}], [[1, 40]], Scripted(tokenizer, ["1"]), SamplingParams(max_new_tokens=4),
                     env=load_environment(section), tokenizer=tokenizer, settings=section)
    assert str(caught.value).startswith(f"environment '{url}' on row 0 {{'prompt': 'a'}}: reset failed: POST {url}"
                                        f"/reset failed 1 time; last: cannot reach it")


def test_a_slow_server_times_out_each_try(server):
    server.delay_s = 0.6
    env = HttpEnvironment(server.url, timeout_s=0.2, retries=1, backoff_s=0.01)
    with pytest.raises(HttpEnvError, match=r"/reset failed 2 times; last: no complete answer within 0.2 s "
                                           r"\(env.timeout_s, a deadline per try\)"):
        env.reset({"n": 1})
    assert len(server.requests) == 2
    first, second = (body["request_id"] for _, body in server.requests)
    assert first == second  # a retry repeats its call's request id


def test_failures_are_retried_until_the_server_answers(server):
    server.failures_left = 2
    env = HttpEnvironment(server.url, timeout_s=5, retries=2, backoff_s=0.01)
    assert env.reset({"n": 1}) == "count 1:"
    assert len(server.requests) == 3
    server.failures_left = 3
    with pytest.raises(HttpEnvError, match=r"/step failed 3 times; last: answered HTTP 503 Service Unavailable: "
                                           r"\{\"error\": \"busy\"\}"):
        env.step("1")


def test_client_errors_and_answers_outside_the_protocol_fail_at_once(server):
    env = HttpEnvironment(server.url, timeout_s=5, retries=3, backoff_s=0.01)
    env.reset({"n": 1})
    server.status = 404
    with pytest.raises(HttpEnvError, match=r"/step answered HTTP 404 Not Found: \{\"error\": \"no such episode\"\}"):
        env.step("1")
    server.status = 200
    server.reply = {"observation": "x", "done": False}
    with pytest.raises(HttpEnvError, match=r"/step answered without 'reward'"):
        env.step("1")
    server.reply = {"observation": "x"}
    with pytest.raises(HttpEnvError, match=r"/reset answered without 'episode_id'"):
        HttpEnvironment(server.url).reset({})
    assert len(server.requests) == 4  # none of these was tried twice


def test_the_longest_call_bounds_every_try_and_pause():
    assert HttpEnvironment.longest_call_s(2.0, 0) == 2.0
    assert HttpEnvironment.longest_call_s(2.0, 2, backoff_s=0.5) == 6.0 + 0.5 + 1.0
    section = EnvSection(http_url="http://x", timeout_s=3, retries=1, max_turns=2)
    # the driver gives the client's own deadline time to fire first (its error says what the server did)
    assert load_environment(section).call_timeout_s == HttpEnvironment.longest_call_s(3, 1) + HTTP_CALL_MARGIN_S
    assert episode_bound_s(section) == 3 * load_environment(section).call_timeout_s  # reset and 2 steps


def test_urls_with_credentials_or_other_schemes_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"env.http_url must start with http:// or https://"):
        EnvSection(http_url="ftp://host/env").validate()
    with pytest.raises(ConfigError) as caught:
        EnvSection(http_url="http://me:hunter2@host/env").validate()
    assert "env.http_url holds a user name or password" in str(caught.value) and "hunter2" not in str(caught.value)
    for url in ("http://host/env?token=hunter2", "http://host/env?api_key=hunter2"):
        with pytest.raises(ConfigError, match=r"^env.http_url holds a credential in the query parameter .* named "
                                              r"in env.headers_from_env") as caught:
            EnvSection(http_url=url).validate()
        assert "hunter2" not in str(caught.value)
        with pytest.raises(HttpEnvError, match=r"^env.http_url holds a credential") as caught:
            HttpEnvironment(url)
        assert "hunter2" not in str(caught.value)
    EnvSection(http_url="http://host/env?lang=en").validate()
    with pytest.raises(HttpEnvError, match="env.http_url must start with"):
        HttpEnvironment("file:///etc/passwd")
    for bad in ({"Bad Name": "X"}, {"X-Key": "not a variable"}):
        with pytest.raises(ConfigError, match="env.headers_from_env"):
            EnvSection(http_url="http://host", headers_from_env=bad).validate()
    with pytest.raises(ConfigError, match=r"env.max_reply_mb must be > 0"):
        EnvSection(http_url="http://host", max_reply_mb=0).validate()


def test_headers_are_read_from_the_environment_and_their_values_appear_in_no_message(server, monkeypatch):
    seen = []
    server.reply = None
    monkeypatch.setenv("HPC_RLHF_TEST_ENV_TOKEN", "Bearer s3cret")
    section = EnvSection(http_url=server.url + "?lang=en", timeout_s=5,
                         headers_from_env={"Authorization": "HPC_RLHF_TEST_ENV_TOKEN"})
    factory = load_environment(section)
    assert factory.name == f"{server.url}?..."
    env = factory.make()
    original = server.httpd.RequestHandlerClass.do_POST

    def recording(handler):
        seen.append(handler.headers.get("Authorization"))
        original(handler)
    server.httpd.RequestHandlerClass.do_POST = recording
    env.reset({"n": 1})
    assert seen == ["Bearer s3cret"]
    server.status = 404
    with pytest.raises(HttpEnvError) as caught:
        env.step("1")
    assert "s3cret" not in str(caught.value) and "lang=en" not in str(caught.value)
    monkeypatch.delenv("HPC_RLHF_TEST_ENV_TOKEN")
    with pytest.raises(EnvError, match=r"env.headers_from_env: header Authorization is read from the environment "
                                       r"variable HPC_RLHF_TEST_ENV_TOKEN, which is not set"):
        load_environment(section)


def test_unusable_replies_are_episode_errors_that_skip_drops(server, tokenizer):
    """A reward too large for a float or for float32, JSON nested too deep, bytes that are not text: each one
    line naming the environment and the row, and with env.on_error=skip only that episode is dropped."""
    section = EnvSection(http_url=server.url, timeout_s=5, retries=0, on_error="skip", max_turns=1)
    cases = [({"observation": "x", "reward": 10 ** 400, "done": True}, "too large for a float"),
             ({"observation": "x", "reward": 1e39, "done": True}, "past float32's range"),
             ({"observation": "x", "reward": [[[[1]]]], "done": True}, "rewards must be numbers")]
    for reply, message in cases:
        server.reply = None
        env_factory = load_environment(section)
        server.reply_step = reply
        batch = run_episodes([{"prompt": "a", "n": 1}], [[1, 40]], Scripted(tokenizer, ["1"]),
                             SamplingParams(max_new_tokens=4), env=env_factory, tokenizer=tokenizer, settings=section)
        episode = batch.episodes[0]
        assert episode.failed and message in episode.error, episode.error
        assert episode.error.startswith(f"environment '{server.url}' on row 0 ")
        assert not episode.mask.any()
