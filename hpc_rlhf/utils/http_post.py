"""One JSON POST to a server the job does not trust (an HTTP environment, a remote reward endpoint), bounded.

DESIGN §8: servers the job calls are untrusted. So a call here is bounded in time and in size, and tells its caller
whether trying again can help:

- time: `timeout_s` is a wall-clock deadline for the whole try (connect, send, status, headers, body). urllib's
  timeout bounds each socket read only, so a server sending a byte at a time was never timed out; here every read
  is given what is left of the deadline, and none is started after it.
- size: a reply body longer than `max_bytes` is refused as soon as it passes the cap (or at once, when its
  Content-Length says so); the body is never read whole first.
- threads and sockets: the call runs in the caller's thread and closes its connection on every path, so a given-up
  try leaves nothing behind.
- URLs: http and https only. A URL that carries a credential (`url_credential`: a user name or password, or a
  query parameter named like one: key, token, secret, password, auth, sig, ...) is refused when the config is
  checked, since config.yaml keeps the URL as given; credentials go in headers whose values are read from
  environment variables the config names (`headers_from_env`), and those values reach no log, error or file.
  Messages show URLs without their query (`shown_url`); a query parameter under another name is allowed and is
  written to config.yaml with its URL.

Plain stdlib (http.client): no new dependency.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import socket
import time
from typing import Any, Mapping
from urllib.parse import unquote_plus, urlsplit

SCHEMES = ("http", "https")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)
_READ_CHUNK = 64 * 1024
# Query parameter names that hold a credential: these exactly, any name containing one of _CREDENTIAL_WORDS, and any
# name that ends in "key" (api_key, X-Api-Key, accesskey; not keyword or keys).
_CREDENTIAL_NAMES = frozenset({"token", "secret", "password", "passwd", "pwd", "auth", "authorization", "signature",
                               "sig"})
_CREDENTIAL_WORDS = ("token", "secret", "password")


class HttpCallError(Exception):
    """One try failed. `retry`: another try may succeed (unreachable, too slow, 5xx, broken off); a 4xx answer or a
    reply that is too big or not JSON would come back the same. The message names no URL: the caller adds it."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


def url_credential(url: str) -> str | None:
    """What in `url` carries a credential, in words for a message that never hold its value ("a user name or
    password", "a credential in the query parameter 'token'"); None when nothing does. Raises ValueError where
    urlsplit does."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        return "a user name or password"
    for pair in re.split(r"[&;]", parts.query):  # ';' too: some servers split a query there
        name = unquote_plus(pair.partition("=")[0]).strip()
        lowered = name.lower()
        if lowered in _CREDENTIAL_NAMES or lowered.endswith("key") or any(w in lowered for w in _CREDENTIAL_WORDS):
            return f"a credential in the query parameter {name!r}"
    return None


def url_problem(url: str, headers_key: str) -> str | None:
    """Why `url` cannot be called (None when it can): not http/https, no host, or a credential in it, which would
    be written to config.yaml with the URL; `headers_key` names the config key for headers read from environment
    variables, where the credential belongs."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in SCHEMES:
        return f"must start with http:// or https:// (got {shown_url(url)!r})"
    if not parts.hostname:
        return f"has no host ({shown_url(url)!r})"
    credential = url_credential(url)
    if credential is not None:
        return (f"holds {credential} ({shown_url(url)!r}), which config.yaml and logs would keep: "
                f"send it as a header whose value is read from an environment variable named in {headers_key} "
                f"(e.g. {headers_key}: {{Authorization: MY_TOKEN}}) and remove it from the URL")
    return None


def shown_url(url: str) -> str:
    """`url` as messages show it: without user:password@ and with its query replaced by `?...` (a token there
    stays out of logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}" + ("?..." if parts.query else "")


def header_mapping_problem(mapping: Any, key: str) -> str | None:
    """What is wrong with a header name -> environment variable name mapping (config key `key`), or None."""
    if not isinstance(mapping, Mapping):
        return f"{key} must map header names to environment variable names, got {type(mapping).__name__}"
    for name, variable in mapping.items():
        if not isinstance(name, str) or not _HEADER_NAME.match(name):
            return f"{key}: {name!r} is not an HTTP header name"
        if not isinstance(variable, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", variable):
            return f"{key}: header {name} must name an environment variable (letters, digits, _), got {variable!r}"
    return None


def headers_from_env(mapping: Mapping[str, str], key: str, environ: Mapping[str, str] = os.environ
                     ) -> dict[str, str]:
    """The headers that `mapping` (header name -> environment variable name, config key `key`) names, with their
    values read from `environ`. ValueError naming the key, the header and the variable (never a value)."""
    problem = header_mapping_problem(mapping, key)
    if problem is not None:
        raise ValueError(problem)
    headers = {}
    for name, variable in mapping.items():
        value = environ.get(variable)
        if value is None:
            raise ValueError(f"{key}: header {name} is read from the environment variable {variable}, which is not "
                             f"set on this process")
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"{key}: the environment variable {variable} (header {name}) holds a line break or a "
                             f"NUL, which a header cannot carry")
        headers[name] = value
    return headers


def post_json(url: str, body: bytes, *, timeout_s: float, max_bytes: int, headers: Mapping[str, str] | None = None,
              timeout_key: str = "timeout_s", cap_key: str = "max_reply_mb") -> bytes:
    """POST `body` (JSON) to `url` once; the reply body of a 2xx answer. HttpCallError otherwise, saying what went
    wrong in words that name the limit's config key (`timeout_key`, `cap_key`)."""
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout_s)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    late = f"no complete answer within {timeout_s:g} s ({timeout_key}, a deadline per try)"
    sock = None
    try:
        connection.connect()
        sock = connection.sock
        connection.sock = _DeadlineSocket(sock, deadline)
        connection.request("POST", target, body=body,
                           headers={"Content-Type": "application/json", **dict(headers or {})})
        response = connection.getresponse()
        if response.status >= 400:
            detail = _text(_read_capped(response, min(max_bytes, 4096), cap_key, truncate=True), 120)
            reason = f"answered HTTP {response.status} {response.reason}" + (f": {detail}" if detail else "")
            raise HttpCallError(reason, retry=response.status >= 500)
        length = response.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise HttpCallError(f"answered {int(length) / 2 ** 20:.3g} MB, more than the cap of "
                                f"{max_bytes / 2 ** 20:.3g} MB ({cap_key})", retry=False)
        return _read_capped(response, max_bytes, cap_key)
    except HttpCallError:
        raise
    except (TimeoutError, socket.timeout):
        raise HttpCallError(late, retry=True) from None
    except http.client.HTTPException as exc:  # IncompleteRead, RemoteDisconnected, BadStatusLine, LineTooLong, ...
        raise HttpCallError(f"the answer broke off or is not HTTP ({type(exc).__name__}: {_text(exc, 100)})",
                            retry=True) from None
    except OSError as exc:  # refused, reset, no route, DNS, TLS
        raise HttpCallError(f"cannot reach it ({_text(exc, 100)})", retry=True) from None
    except ValueError as exc:  # http.client refusing a header (its message quotes the value: a secret, perhaps)
        raise HttpCallError(f"the request could not be sent ({type(exc).__name__} in a header)", retry=False) from None
    finally:
        connection.close()
        if sock is not None:
            sock.close()  # the wrapper leaves closing to here: http.client closes the connection before the body


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """A reply body as a JSON object; HttpCallError (not retried) for anything else: bytes that are not UTF-8,
    text that is not JSON, an integer too long to read, nesting too deep for the parser."""
    try:
        decoded = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HttpCallError(f"answered bytes that are not UTF-8 text ({exc.reason} at byte {exc.start})",
                            retry=False) from None
    except RecursionError:
        raise HttpCallError("answered JSON nested too deeply to read", retry=False) from None
    except ValueError as exc:  # JSONDecodeError, and the int-length limit of int()
        raise HttpCallError(f"answered something that is not JSON ({_text(exc, 80)}): "
                            f"{_text(raw.decode('utf-8', errors='replace'), 80)}", retry=False) from None
    if not isinstance(decoded, dict):
        raise HttpCallError(f"answered {_text(json.dumps(decoded), 60)}; a JSON object was expected", retry=False)
    return decoded


class _DeadlineSocket:
    """The connection's socket, giving each send and read what is left of the try's deadline (http.client uses
    sendall, makefile and close of its socket)."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(left)

    def sendall(self, data) -> None:
        self.arm()  # since Python 3.5 the timeout bounds the whole sendall
        self.sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        pass  # http.client closes a connection that ends with its reply before reading the body: post_json closes

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _DeadlineSocket):
        super().__init__()
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.owner.arm()
        return self.owner.sock.recv_into(buffer)


def _read_capped(response: http.client.HTTPResponse, max_bytes: int, cap_key: str, truncate: bool = False) -> bytes:
    """The body, read in chunks; HttpCallError as soon as it passes `max_bytes` (with `truncate`: its first
    `max_bytes` bytes, for an error answer's detail)."""
    chunks, size = [], 0
    while True:
        chunk = response.read(min(_READ_CHUNK, max_bytes + 1 - size))
        if not chunk:
            if response.length:  # read(n) does not raise IncompleteRead when the body stops short: say it here
                raise HttpCallError(f"the answer broke off after {size} bytes, {response.length} short of its "
                                    f"Content-Length", retry=True)
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            if truncate:
                return b"".join(chunks)[:max_bytes]
            raise HttpCallError(f"answered more than the cap of {max_bytes / 2 ** 20:.3g} MB ({cap_key})",
                                retry=False)


def _text(value: Any, limit: int) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
