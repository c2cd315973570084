"""The job's rendezvous store, private to the job: every key in a namespace derived from a per-job secret, every
value sealed with it.

Why: torch's TCPStore has no authentication. Anyone who can reach its port (another user of the node, or of the
network) can read, write and delete keys, and list them all (`list_keys`). Through it they could append a failure
record to the watchdog's log (every rank would exit with a message of their choosing), set the store process's
close key, or rewrite torch's own rendezvous keys (where a rank finds its peers).

So the ranks talk to the store through `guarded(store, secret)`:
- keys live under `namespace(secret)`, a digest of the secret: a writer who does not know the secret does not know
  where the job's keys are, and the listed names do not tell it the secret;
- each value is sealed, an HMAC-SHA256 of the key, the kind of write and the value: a value written by anyone
  else (or moved from another key) is not the job's and is not read. A key that holds no sealed value counts as
  not yet written: `get` waits for one, until the store's timeout, and then names the key.

What it cannot stop (docs/failures.md, "Who can steer a job"): a process that lists the keys can delete or
overwrite them, or replay an older sealed value of the same key, which ends the job (a clear line naming the
key, or the watchdog's) but cannot make it do what the writer chose; counters (`add`) are not sealed, and ours
only tell readers when to look. The secret comes from the launcher, in HPC_RLHF_STORE_SECRET (`secret_from_env`);
it is never logged, written to config.yaml, or passed to vLLM's processes.

Sealed values are text lines, so that appends (the failure log, the world-size check) stay readable record by
record: `\\n<mac hex> <s|a> <base64 value>\\n`. A reader keeps the last sealed `set` and the sealed appends after
it, exactly what the store itself does with set and append, and skips every line that is not sealed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import time
from datetime import timedelta
from typing import Mapping

SECRET_VAR = "HPC_RLHF_STORE_SECRET"
NAMESPACE_ROOT = "hpc_rlhf/job"
POLL_S = 0.05
_SET, _APPEND = b"s", b"a"


class StoreTampered(RuntimeError):
    """A key of the job holds no value sealed with the job's secret: something else wrote it."""


def make_secret() -> str:
    return secrets.token_hex(32)


def secret_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The job's secret, as the launcher or the user set it (None when unset or empty)."""
    value = (os.environ if env is None else env).get(SECRET_VAR, "").strip()
    return value or None


def namespace(secret: str) -> str:
    """Where the job's keys live: a digest of the secret, so that listing the keys does not reveal it."""
    return f"{NAMESPACE_ROOT}/{hmac.new(secret.encode(), b'namespace', hashlib.sha256).hexdigest()[:32]}"


# ------------------------------------------------------------------------------------------------ the seal
def _mac(secret: bytes, key: str, kind: bytes, value: bytes) -> bytes:
    message = key.encode() + b"\0" + kind + b"\0" + value
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


def seal(secret: str, key: str, value: bytes, *, append: bool = False) -> bytes:
    """`value` as it is stored under `key`: one sealed line."""
    kind = _APPEND if append else _SET
    return b"\n" + _mac(secret.encode(), key, kind, value) + b" " + kind + b" " + base64.b64encode(value) + b"\n"


def unseal(secret: str, key: str, stored: bytes) -> tuple[bytes | None, int]:
    """(the value the job wrote under `key`, or None if no sealed line is there; how many lines were not sealed)."""
    value, foreign, secret_bytes = None, 0, secret.encode()
    for line in stored.split(b"\n"):
        if not line:
            continue
        parts = line.split(b" ")
        if len(parts) != 3 or parts[1] not in (_SET, _APPEND):
            foreign += 1
            continue
        mac, kind, encoded = parts
        try:
            payload = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            foreign += 1
            continue
        if not hmac.compare_digest(mac, _mac(secret_bytes, key, kind, payload)):
            foreign += 1
            continue
        value = payload if kind == _SET else (value or b"") + payload
    return value, foreign


def _as_bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


# ------------------------------------------------------------------------------------------------ the store
def guarded(store, secret: str, prefix: str = ""):
    """`store` (a client of the job's TCPStore) seen through the job's namespace and seal, keys under `prefix/`
    (as torch's PrefixStore names them): a torch Store, which init_process_group and the watchdog use like any
    other.

    Keep a reference to it while torch uses it: a torch store that wraps a Python one (PrefixStore,
    init_process_group's) does not keep the Python object alive. Hence `prefix` here rather than a PrefixStore
    around it."""
    import torch.distributed as dist

    class GuardedStore(dist.Store):
        def __init__(self):
            super().__init__()
            self.underlying_store = store  # the watchdog finds the TCP address through this name (PrefixStore's)
            self._namespace = namespace(secret) + "/"
            self._prefix = f"{prefix}/" if prefix else ""
            self._timeout = store.timeout

        def _key(self, key: str) -> str:
            return self._namespace + self._prefix + key

        def _sealed(self, key: str, value, append: bool = False) -> bytes:
            return seal(secret, self._prefix + key, _as_bytes(value), append=append)

        def set(self, key, value):
            store.set(self._key(key), self._sealed(key, value))

        def append(self, key, value):
            store.append(self._key(key), self._sealed(key, value, append=True))

        def get_if_sealed(self, key: str) -> bytes | None:
            """The job's value of `key` now, or None (unset, or nothing sealed there): never waits."""
            if not store.check([self._key(key)]):
                return None
            return unseal(secret, self._prefix + key, store.get(self._key(key)))[0]

        def get(self, key):
            deadline = time.monotonic() + self._timeout.total_seconds()
            store.wait([self._key(key)], self._timeout)
            while True:
                value = self.get_if_sealed(key)
                if value is not None:
                    return value
                if time.monotonic() >= deadline:
                    raise StoreTampered(
                        f"the rendezvous store's key '{self._prefix}{key}' holds a value that this job did not write (not sealed "
                        f"with its {SECRET_VAR}), and no value of the job replaced it within "
                        f"{self._timeout.total_seconds():g} s: another process wrote to the job's store "
                        "(docs/failures.md, 'Who can steer a job')")
                time.sleep(POLL_S)

        def add(self, key, amount):
            return store.add(self._key(key), amount)

        def check(self, keys):
            return store.check([self._key(k) for k in keys])

        def wait(self, keys, timeout=None):
            keys = [self._key(k) for k in keys]
            return store.wait(keys) if timeout is None else store.wait(keys, timeout)

        def delete_key(self, key):
            return store.delete_key(self._key(key))

        def num_keys(self):
            return store.num_keys()

        def set_timeout(self, timeout: timedelta):
            self._timeout = timeout
            store.set_timeout(timeout)

        @property
        def timeout(self) -> timedelta:
            return self._timeout

        def compare_set(self, key, expected, desired):
            # Not atomic through a seal (the store compares the sealed bytes): no code of the job's path uses it.
            raise NotImplementedError("compare_set on the job's guarded store (hpc_rlhf.dist.store_guard)")

    return GuardedStore()
