"""The reference HTTP environment server (examples/envs/http_server.py) with the client: a step whose answer comes
after the client's deadline is applied once (its retry carries the same request id and gets the kept answer), so
the rewards are those of a server that answered in time; a step sent again under a new id is refused."""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.request
from pathlib import Path

import pytest

from hpc_rlhf.envs.http import HttpEnvError, HttpEnvironment

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "http_server.py"
_spec = importlib.util.spec_from_file_location("example_http_server", EXAMPLE)
http_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(http_server)


class Counter:
    """Counts to two: each step is rewarded 1 when the action is the number of steps applied so far, so a step
    applied twice shifts every later reward. `slow` makes the first step of each episode take `SLOW_S`."""

    SLOW_S = 0.5
    slow = False
    applied = 0  # steps applied, over all episodes

    def reset(self, row):
        self.steps = 0
        return "count:"

    def step(self, action):
        if Counter.slow and self.steps == 0:
            time.sleep(Counter.SLOW_S)  # applied now; the answer comes after the client's deadline
        self.steps += 1
        Counter.applied += 1
        return f" {self.steps}", 1.0 if action == str(self.steps) else 0.0, self.steps == 2


@pytest.fixture()
def served():
    Counter.slow, Counter.applied = False, 0
    server, protocol = http_server.serve(Counter)
    yield f"http://127.0.0.1:{server.server_address[1]}", protocol
    server.shutdown()
    server.server_close()


def play(url: str) -> list[float]:
    # tries of 0.2 s with pauses growing from 0.01 s: the slow step's answer (after 0.5 s) comes within them
    env = HttpEnvironment(url, timeout_s=0.2, retries=8, backoff_s=0.01)
    env.reset({})
    return [env.step("1")[1], env.step("2")[1]]


def test_a_step_answered_after_the_deadline_is_applied_once(served):
    url, protocol = served
    assert play(url) == [1.0, 1.0] and Counter.applied == 2
    Counter.slow, Counter.applied = True, 0
    assert play(url) == [1.0, 1.0]  # the same rewards: the retries got the first try's answer
    assert Counter.applied == 2
    assert protocol.repeats >= 1  # the first step was tried again (its answer came after 0.2 s)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_repeated_step_under_a_new_request_id_is_refused_and_not_applied(served):
    url, _ = served
    _, reset = post(f"{url}/reset", {"row": {}, "turn": 0, "request_id": "r0"})
    episode = reset["episode_id"]
    step = {"episode_id": episode, "action": "1", "turn": 1, "request_id": "r1"}
    assert post(f"{url}/step", step) == (200, {"observation": " 1", "reward": 1.0, "done": False, "info": {}})
    assert post(f"{url}/step", step)[1]["reward"] == 1.0  # the same id: the kept answer
    status, answer = post(f"{url}/step", {**step, "request_id": "r2"})  # the same turn under a new id
    assert status == 409 and "turn 1 is not the next one (2)" in answer["error"]
    assert Counter.applied == 1
    assert post(f"{url}/step", {"episode_id": episode, "action": "1"})[0] == 400  # no request id


def test_the_server_script_refuses_a_bad_env_spec():
    with pytest.raises(SystemExit, match="has no class Nope"):
        http_server.load_class(f"{Path(__file__)}:Nope")


def test_an_environment_error_is_answered_once_and_named_by_the_client():
    Counter.applied = 0

    class Broken(Counter):
        def step(self, action):
            Counter.applied += 1
            raise RuntimeError("tool crashed")

    server, _ = http_server.serve(Broken)
    try:
        env = HttpEnvironment(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5, retries=2,
                              backoff_s=0.01)
        env.reset({})
        with pytest.raises(HttpEnvError, match=r"/step failed 3 times; last: answered HTTP 500 Internal Server "
                                               r"Error: \{\"error\": \"RuntimeError: tool crashed\"\}"):
            env.step("1")
        assert Counter.applied == 1  # its retries got the kept answer: the crashed step ran once
    finally:
        server.shutdown()
        server.server_close()
