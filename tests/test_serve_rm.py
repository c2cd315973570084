"""hpc_rlhf/serve_rm.py (`hpc-rlhf serve-rm`): a served reward model answers the RL recipes' remote reward client with
the rewards the in-job reward role computes for the same tokens; what a request or the command line gets wrong is
refused by name; the network is let in only with a secret."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import threading
import time

import pytest
import torch

from hpc_rlhf import serve_rm
from hpc_rlhf.rewards import RewardFunctionError, remote_rewards

TINY_MODEL = "examples/tiny/assets/models/llama-tiny"
PROMPTS = ["47+74=", "1+65=", "42+11=", "0+60=", "5+66="]
RESPONSES = ["121<eos>", "66<eos>", "5", "60<eos>", "71"]  # the RL client's decoding keeps the end token as text


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A reward model folder as `hpc-rlhf rm` writes one: the tiny body, a seeded head, normalisation constants."""
    from hpc_rlhf.config import ModelSection
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.models.value_model import build_value_model, save_value_model, set_reward_normalization

    torch.manual_seed(3)
    model = build_value_model(ModelSection(path=TINY_MODEL), for_training=False)
    set_reward_normalization(model, 0.5, 2.0)
    folder = tmp_path_factory.mktemp("serve_rm") / "rm"
    save_value_model(model, folder, tokenizer=load_tokenizer(TINY_MODEL))
    return folder


@pytest.fixture(scope="module")
def scorer(reward_model):
    return serve_rm.RewardScorer(str(reward_model), max_len=64, batch_size=2, normalize=False, chat_template=False)


@contextlib.contextmanager
def serving(scorer, token=None, max_request_bytes=1 << 20, max_texts=100, read_timeout_s=10.0, max_connections=64):
    server = serve_rm.make_server(scorer, "127.0.0.1", 0, token=token, max_request_bytes=max_request_bytes,
                                  max_texts=max_texts, read_timeout_s=read_timeout_s, max_connections=max_connections)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def in_job_rewards(folder, sequences: list[list[int]], normalize: bool) -> list[float]:
    """What the RL recipes' reward role computes: the value model's score at the last token of each sequence."""
    from hpc_rlhf.config import ModelSection
    from hpc_rlhf.models.value_model import build_value_model, sequence_scores

    model = build_value_model(ModelSection(path=str(folder), init_value_head=False), for_training=False)
    with torch.no_grad():
        return [float(sequence_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long),
                                      normalize=normalize)) for s in sequences]


def test_the_rl_clients_request_gets_the_in_job_rewards(reward_model, scorer):
    from hpc_rlhf.data.examples import prompt_examples
    from hpc_rlhf.models.builders import load_tokenizer

    tokenizer = load_tokenizer(TINY_MODEL)
    # the ids the RL step holds: the prompt as the recipes tokenise it, the response as generated (EOS included)
    prompt_ids = [e["input_ids"] for e in prompt_examples(tokenizer, PROMPTS, max_prompt_len=64)]
    response_ids = [tokenizer(r.replace("<eos>", ""), add_special_tokens=False)["input_ids"] +
                    ([tokenizer.eos_token_id] if r.endswith("<eos>") else []) for r in RESPONSES]
    assert [tokenizer.decode(r, skip_special_tokens=False) for r in response_ids] == RESPONSES
    sequences = [p + r for p, r in zip(prompt_ids, response_ids)]
    with serving(scorer) as url:
        for normalize in (False, True):
            scorer.normalize = normalize
            try:
                served = remote_rewards(url, PROMPTS, RESPONSES, [None] * len(PROMPTS))
            finally:
                scorer.normalize = False
            expected = in_job_rewards(reward_model, sequences, normalize)
            assert served == pytest.approx(expected, abs=1e-5, rel=1e-5)
        assert len(set(served)) == len(served)  # distinct sequences, distinct rewards: the test can tell them apart
        # OpenRLHF's clients send whole texts: tokenised as they are, special tokens written as text included
        texts = [p + r for p, r in zip(PROMPTS, RESPONSES)]
        reply = post(url, {"query": texts})
        whole = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        assert reply[0] == 200 and reply[1]["rewards"] == pytest.approx(in_job_rewards(reward_model, whole, False),
                                                                         abs=1e-5, rel=1e-5)


def post(url: str, payload, headers: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = raw if raw is not None else json.dumps(payload).encode()
    connection.request("POST", "/", body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    answer = response.status, json.loads(response.read())
    connection.close()
    return answer


def test_bad_requests_are_refused_by_name_and_the_server_goes_on(scorer):
    with serving(scorer, max_request_bytes=2000, max_texts=3) as url:
        assert post(url, None, raw=b"{not json") == (400, {"error": "the body is not JSON in UTF-8 (JSONDecodeError)"})
        status, reply = post(url, {"prompts": ["1+1="], "responses": ["2", "3"]})
        assert status == 400 and "'prompts' must be a list as long as 'responses' (2)" in reply["error"]
        status, reply = post(url, {"prompts": ["1+1=", 7], "responses": ["2", "3"]})
        assert status == 400 and reply["error"].startswith("prompts[1] is neither text nor a list of messages")
        status, reply = post(url, {"query": ["a", "b", "c", "d"]})
        assert status == 413 and "'query' has 4 texts; this server takes at most 3" in reply["error"]
        status, reply = post(url, {"query": ["x" * 3000]})
        assert status == 413 and "at most 2000 (--max-request-mb)" in reply["error"]
        status, reply = post(url, {"responses": ["2"]})
        assert status == 400 and "needs 'prompts' and 'responses'" in reply["error"]
        status, reply = post(url, {"prompts": ["1+1="], "responses": ["2"]})
        assert status == 200 and len(reply["rewards"]) == 1


def test_with_a_secret_only_its_holders_are_answered(scorer):
    with serving(scorer, token="s3cret") as url:
        assert post(url, {"query": ["1"]})[0] == 401
        assert post(url, {"query": ["1"]}, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert post(url, {"query": ["1"]}, headers={"Authorization": "Bearer s3cret"})[0] == 200
        # the RL client's error names the status and the reason, not the secret
        with pytest.raises(RewardFunctionError, match="answered HTTP 401.*no or wrong 'Authorization: Bearer'"):
            remote_rewards(url, ["1+1="], ["2"], [None])
        assert remote_rewards(url, ["1+1="], ["2"], [None], headers={"Authorization": "Bearer s3cret"})


def test_a_failure_in_scoring_is_answered_and_the_server_goes_on(scorer, monkeypatch):
    with serving(scorer) as url:
        monkeypatch.setattr(scorer, "rewards", lambda sequences: 1 / 0)
        assert post(url, {"query": ["1"]}) == (500, {"error": "scoring failed: ZeroDivisionError: division by zero"})
        monkeypatch.undo()
        assert post(url, {"query": ["1"]})[0] == 200


def test_a_client_that_sends_slowly_loses_its_connection_not_the_server(scorer, capfd):
    with serving(scorer, read_timeout_s=0.5) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"query\"")
        started = time.monotonic()
        assert post(url, {"query": ["1"]})[0] == 200  # served while the slow one waits
        slow.settimeout(10)
        assert slow.recv(100) == b""  # closed by the server at its read timeout
        assert time.monotonic() - started < 10
        slow.close()
    assert "no whole request within 0.5 s (--read-timeout-s)" in capfd.readouterr().err


@pytest.mark.parametrize("cut_in", ["body", "headers"])
def test_a_client_that_trickles_its_request_loses_it_at_the_deadline(scorer, capfd, cut_in):
    """A byte every 0.1 s would renew a per-read timeout forever: the whole request must come within the time,
    its headers as its body; the cut is one line in the log, not a traceback."""
    head = b"POST / HTTP/1.0\r\nHost: x\r\nContent-Length: 400\r\n\r\n"
    sent = head + b" " * 400 if cut_in == "body" else b"POST / HTTP/1.0\r\nHost: " + b"x" * 400
    with serving(scorer, read_timeout_s=0.6) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        trickle = socket.create_connection(("127.0.0.1", port))
        started, closed = time.monotonic(), False
        try:
            for byte in sent:
                trickle.sendall(bytes([byte]))
                time.sleep(0.1)
                if time.monotonic() - started > 10:
                    break
        except OSError:  # the server shut the connection
            closed = True
        trickle.settimeout(5)
        with contextlib.suppress(OSError):
            closed = closed or trickle.recv(100) == b""
        trickle.close()
        assert closed and time.monotonic() - started < 5
        assert post(url, {"query": ["1"]})[0] == 200
    err = capfd.readouterr().err
    assert "no whole request within 0.6 s (--read-timeout-s)" in err and "Traceback" not in err, err


def test_connections_beyond_the_limit_are_answered_busy_and_the_slots_come_back(scorer, capfd):
    with serving(scorer, max_connections=2, read_timeout_s=30.0) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.3)  # both taken by their threads
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(10)
        reply = b""
        while chunk := extra.recv(4096):
            reply += chunk
        extra.close()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 503") and "--max-connections" in json.loads(body)["error"]
        for connection in idle:
            connection.close()
        for _ in range(50):  # their threads end as they read the closed connections
            with contextlib.suppress(OSError):
                if post(url, {"query": ["1"]})[0] == 200:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("no slot came back after the idle connections closed")
        assert all(post(url, {"query": ["1"]})[0] == 200 for _ in range(3))
    assert "refused (503): 2 connections already (--max-connections)" in capfd.readouterr().err


def test_the_network_needs_a_secret_or_an_explicit_choice(monkeypatch, reward_model, capsys):
    def args(*argv):
        return serve_rm.parse_args([str(reward_model), *argv])

    with pytest.raises(ValueError, match="--host 0.0.0.0 lets other machines in: give a secret with --token-env"):
        serve_rm.secret_of(args("--host", "0.0.0.0"))
    assert serve_rm.secret_of(args("--host", "0.0.0.0", "--allow-anyone")) is None
    assert serve_rm.secret_of(args()) is None  # loopback
    monkeypatch.delenv("RM_SECRET", raising=False)
    with pytest.raises(ValueError, match="--token-env RM_SECRET: that environment variable is not set"):
        serve_rm.secret_of(args("--token-env", "RM_SECRET"))
    monkeypatch.setenv("RM_SECRET", "abc")
    assert serve_rm.secret_of(args("--host", "0.0.0.0", "--token-env", "RM_SECRET")) == "abc"
    # the command refuses before it loads anything or listens
    assert serve_rm.main([str(reward_model), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert serve_rm.main(["/nowhere/rm", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 lets other machines in" in err and "model folder '/nowhere/rm' does not exist" in err
    with pytest.raises(SystemExit):
        serve_rm.parse_args([str(reward_model), "--max-len", "0"])
    with pytest.raises(SystemExit):
        serve_rm.parse_args([str(reward_model), "--max-connections", "0"])
    assert isinstance(args(), argparse.Namespace)


def test_the_command_serves_until_scancel_s_signal(reward_model):
    """`hpc-rlhf serve-rm` as a job step runs it: it prints where it listens, answers, and ends cleanly on SIGTERM."""
    import re
    import signal
    import subprocess

    from tests.distributed import REPO, rank_python, worker_env

    env = worker_env()  # forked from the tests' pre-imported interpreter, its signals and exit its own
    proc = subprocess.Popen([rank_python(env), "-m", "hpc_rlhf", "serve-rm", str(reward_model), "--port", "0",
                             "--normalize"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert found, (line, proc.stderr.read() if proc.poll() is not None else "")
        rewards = remote_rewards(found.group(1), PROMPTS[:2], RESPONSES[:2], [None, None])
        assert len(rewards) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "serve-rm: 127.0.0.1: 2 rewards in" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
