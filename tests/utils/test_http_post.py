"""The bounded JSON POST (hpc_rlhf/utils/http_post.py) against raw servers on loopback that misbehave the way an
untrusted server can: a reply dripped a byte at a time, a body without end, a lying Content-Length, bytes that are
not JSON; and the URL and header rules that keep secrets out of messages."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from hpc_rlhf.utils.http_post import (HttpCallError, decode_json_object, header_mapping_problem, headers_from_env,
                                      post_json, shown_url, url_credential, url_problem)


def read_request(connection):
    """Reads the whole request, head and body: a server that answers after one `recv` and closes with the body's
    last segment unread makes the kernel reset the connection, and the client then sees a reset instead of the
    reply the test set up (seen once in CI)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            return
        body += chunk


@contextmanager
def raw_server(reply):
    """A TCP server on 127.0.0.1: every connection's request is read, then `reply(connection)` answers it (in a
    thread per connection). Yields the URL; waits for the connection threads to end on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop, threads = threading.Event(), []

    def answer(connection):
        with connection:
            read_request(connection)
            try:
                reply(connection)
            except OSError:  # the client closed: what the tests want
                pass

    def accept():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            thread = threading.Thread(target=answer, args=(connection,), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/score?token=secret"
    finally:
        stop.set()
        acceptor.join(5)
        for thread in threads:
            thread.join(5)
        listener.close()


def settles(condition, within_s: float = 10.0) -> bool:
    """`condition()` became true within a generous bound (threads end a moment after their sockets close)."""
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def drip(connection):
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(1000):  # a byte every 20 ms: each read is quick, the whole reply takes 20 s
        connection.sendall(b" ")
        time.sleep(0.02)


def endless(connection):
    connection.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"rewards\": [")
    while True:
        connection.sendall(b"1, " * 4096)


def answer_with(raw: bytes):
    def reply(connection):
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
    return reply


def open_sockets() -> int:
    """This process's open socket descriptors (the test server's and the client's)."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_a_slow_drip_reply_ends_at_the_deadline_and_leaves_no_thread_behind():
    with raw_server(drip) as url:
        threads, sockets = threading.active_count(), open_sockets()
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(HttpCallError) as caught:
                post_json(url, b"{}", timeout_s=0.3, max_bytes=2 ** 20, timeout_key="reward.http_timeout_s")
            assert time.monotonic() - started < 5  # generous: without the deadline it takes 20 s
            assert str(caught.value) == ("no complete answer within 0.3 s (reward.http_timeout_s, a deadline per "
                                         "try)")
            assert caught.value.retry
        # the client made none; the server's end as they find their connection closed, and no socket stays open
        assert settles(lambda: threading.active_count() <= threads and open_sockets() <= sockets)


def test_an_endless_body_ends_at_the_cap():
    with raw_server(endless) as url:
        threads, sockets = threading.active_count(), open_sockets()
        for _ in range(3):
            with pytest.raises(HttpCallError) as caught:
                post_json(url, b"{}", timeout_s=30, max_bytes=2 ** 16, cap_key="env.max_reply_mb")
            assert str(caught.value) == "answered more than the cap of 0.0625 MB (env.max_reply_mb)"
            assert not caught.value.retry
        assert settles(lambda: threading.active_count() <= threads and open_sockets() <= sockets)


def test_a_declared_length_over_the_cap_is_refused_before_reading():
    with raw_server(answer_with(b"x" * 5000)) as url:
        with pytest.raises(HttpCallError, match=r"answered 0.00477 MB, more than the cap of 0.000954 MB"):
            post_json(url, b"{}", timeout_s=5, max_bytes=1000)


def test_a_reply_that_breaks_off_is_retried():
    def short(connection):
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"rew")
    with raw_server(short) as url:
        with pytest.raises(HttpCallError, match=r"the answer broke off after 5 bytes, 95 short of its Content-Length"
                           ) as caught:
            post_json(url, b"{}", timeout_s=5, max_bytes=1000)
        assert caught.value.retry


@pytest.mark.parametrize("raw,message", [
    (b"\xff\xfe{}", "answered bytes that are not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "answered JSON nested too deeply to read"),
    (b'{"rewards": [' + b"9" * 5000 + b"]}", "answered something that is not JSON"),
    (b"not json", "answered something that is not JSON"),
    (b"[1, 2]", r"answered \[1, 2\]; a JSON object was expected"),
])
def test_replies_that_are_not_a_json_object_are_named(raw, message):
    with pytest.raises(HttpCallError, match=message) as caught:
        decode_json_object(raw)
    assert not caught.value.retry


def test_urls_are_http_only_without_credentials_and_shown_without_secrets():
    assert url_problem("http://host:8000/score", "k") is None and url_problem("https://host/x", "k") is None
    assert "must start with http:// or https://" in url_problem("ftp://host/x", "k")
    assert "must start with http:// or https://" in url_problem("file:///etc/passwd", "k")
    assert "has no host" in url_problem("http:///path", "k")
    problem = url_problem("https://user:hunter2@host/score", "k")
    assert "user name or password" in problem and "hunter2" not in problem
    assert shown_url("https://user:hunter2@host:8/score?token=abc") == "https://host:8/score?..."


@pytest.mark.parametrize("url, credential", [
    ("https://user:hunter2@host/score", "a user name or password"),
    ("https://user@host/score", "a user name or password"),
    ("http://env:8000/x?key=s3cret", "a credential in the query parameter 'key'"),
    ("http://judge/score?lang=en&TOKEN=s3cret", "a credential in the query parameter 'TOKEN'"),
    ("http://judge/score?X-Api-Key=s3cret", "a credential in the query parameter 'X-Api-Key'"),
    ("http://judge/score?client_secret=s3cret", "a credential in the query parameter 'client_secret'"),
    ("http://judge/score?sig=s3cret", "a credential in the query parameter 'sig'"),
    ("http://judge/score?a=1;pwd=s3cret", "a credential in the query parameter 'pwd'"),
    ("http://judge/score?%74oken=s3cret", "a credential in the query parameter 'token'"),  # percent-encoded name
    ("http://judge/score?access_token", "a credential in the query parameter 'access_token'"),  # without a value
    ("http://judge/score", None),
    ("http://judge/score?lang=en&n=2&mode=", None),
    ("http://judge/score?note=token", None),  # a word in a value is not a parameter's name
    ("http://judge/score?keyword=sum&keys=3", None),  # "key" counts at the end of a name only
])
def test_a_url_carries_a_credential_in_its_user_info_or_a_query_parameter_named_like_one(url, credential):
    assert url_credential(url) == credential


def test_a_url_with_a_credential_is_refused_naming_the_header_key_and_not_the_value():
    problem = url_problem("http://env:8000/x?key=s3cret", "env.headers_from_env")
    assert problem.startswith("holds a credential in the query parameter 'key' ('http://env:8000/x?...'), which "
                              "config.yaml and logs would keep: send it as a header whose value is read from an "
                              "environment variable named in env.headers_from_env")
    assert "s3cret" not in problem and "\n" not in problem
    assert url_problem("http://env:8000/x?lang=en", "env.headers_from_env") is None


def test_headers_come_from_environment_variables_and_their_values_stay_out_of_errors():
    environ = {"REWARD_TOKEN": "Bearer s3cret"}
    assert headers_from_env({"Authorization": "REWARD_TOKEN"}, "k", environ) == {"Authorization": "Bearer s3cret"}
    with pytest.raises(ValueError, match=r"^k: header X-Key is read from the environment variable MISSING_VAR, which "
                                         r"is not set on this process$"):
        headers_from_env({"X-Key": "MISSING_VAR"}, "k", environ)
    with pytest.raises(ValueError) as caught:
        headers_from_env({"X-Key": "BAD"}, "k", {"BAD": "s3cret\r\nHost: evil"})
    assert "s3cret" not in str(caught.value) and "line break" in str(caught.value)
    with raw_server(answer_with(b"{}")) as url, pytest.raises(HttpCallError) as caught:
        # a header given directly, past those checks
        post_json(url, b"{}", timeout_s=5, max_bytes=10, headers={"X-Key": "s3cret\u2603"})
    assert "s3cret" not in str(caught.value) and not caught.value.retry
    assert "is not an HTTP header name" in header_mapping_problem({"Bad Header": "X"}, "k")
    assert "must name an environment variable" in header_mapping_problem({"X-Key": "not a var"}, "k")
