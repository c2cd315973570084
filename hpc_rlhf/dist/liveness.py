"""The liveness protocol: what the ranks, the rendezvous store's process and the local launcher tell each other
about who is alive and who failed. Data, keys and single reads and writes only (no threads, no policy), so that
the three parties share one definition and none of them imports another:

- every rank's watchdog (hpc_rlhf.dist.watchdog) writes its heartbeat and failure records, and reads its peers';
- the store's own process (hpc_rlhf.dist.store_host) reads rank 0's last heartbeat when rank 0 is gone, and
  publishes its death;
- the local launcher (hpc_rlhf.launch.local) reads each rank's error file, to name the rank that failed first.

In the rendezvous store, under `key_prefix()` (one prefix per torchrun restart: the agent's store outlives them):

    hb/<rank>        the rank's last heartbeat, JSON: seq, role, phase, step, host, pid, pidns, state
    failures/log     the failure records (`failure_record`), one JSON object a line, appended
    failures/count   how many records the log holds, added after the append: a reader that sees the count finds
                     the record
    seen/<rank>      how many records the rank has read (the store's host waits for its readers before it exits)

A heartbeat's state is RUNNING, STOPPED (an orderly end), FAILED (it is reporting a failure, its own or one it
saw) or TERMINATED (SIGTERM is ending it: its launcher is ending the job).

On disk: a rank started by the local launcher finds a file name in HPC_RLHF_ERROR_FILE; a rank that fails writes
{"time", "message"} there (`record_failure`). A rank that fails makes its peers fail a moment later in their next
collective, and may even exit after them: the recorded times tell which came first.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

KEY_PREFIX = "hpc_rlhf/watchdog"
FAILURE_COUNT, FAILURE_LOG = "failures/count", "failures/log"
RUNNING, STOPPED, FAILED = "running", "stopped", "failed"
TERMINATED = "terminated"  # ended by SIGTERM's default action: its launcher is ending the job
ERROR_FILE_VAR = "HPC_RLHF_ERROR_FILE"


# ------------------------------------------------------------------------------------------------- the store
def key_prefix() -> str:
    """Where this attempt's heartbeats and records live: torchrun's agent store outlives worker restarts."""
    return f"{KEY_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


def seen_key(rank: int) -> str:
    return f"seen/{rank}"


def heartbeat(seq: int, role: str, phase: str, step: int, host: str, pid: int, pidns: str,
              state: str) -> str:
    """A heartbeat as it is stored (JSON)."""
    return json.dumps({"seq": seq, "role": role, "phase": phase, "step": step, "host": host, "pid": pid,
                       "pidns": pidns, "state": state})


class RecordError(ValueError):
    """A heartbeat or failure record in the store that is not one: cut short, or written by something else."""


HEARTBEAT_FIELDS = {"seq": int, "role": str, "phase": str, "step": int, "host": str, "pid": int, "pidns": str,
                    "state": str}
FAILURE_FIELDS = {"rank": int, "role": str, "phase": str, "step": int, "kind": str, "detail": str, "primary": bool,
                  "by": int, "time": (int, float)}
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; a larger one is not ours


def parse_record(raw: bytes | str, fields: Mapping[str, type | tuple], what: str) -> dict[str, Any]:
    """A JSON object with at least `fields`, each of its type (bool is not an int here), or RecordError."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{what}: {len(raw)} bytes, more than a record's {MAX_RECORD_BYTES}")
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RecordError(f"{what}: not JSON ({type(exc).__name__})") from None
    if not isinstance(record, dict):
        raise RecordError(f"{what}: a JSON {type(record).__name__}, not an object")
    for name, kind in fields.items():
        value = record.get(name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise RecordError(f"{what}: field '{name}' is {value!r:.40}, not {getattr(kind, '__name__', kind)}")
    return record


def read_heartbeat(store, rank: int) -> dict[str, Any] | None:
    """`rank`'s last heartbeat in `store` (a PrefixStore on key_prefix()), or None if it never wrote one; a value
    there that is not a heartbeat raises RecordError (the caller reports it and reads the rank as silent)."""
    key = heartbeat_key(rank)
    if not store.check([key]):
        return None
    return parse_record(store.get(key), HEARTBEAT_FIELDS, f"the heartbeat of rank {rank}")


def failure_record(rank: int, role: str, phase: str, step: int, kind: str, detail: str, *, primary: bool,
                   by: int) -> dict[str, Any]:
    """A published failure: `kind` is 'failed' or 'stopped responding'; `by` is the rank that published it (-1:
    the store's process); `primary`: a cause, not the effect of a failure elsewhere (a broken collective)."""
    return {"rank": rank, "role": role, "phase": phase, "step": step, "kind": kind, "detail": detail,
            "primary": primary, "by": by, "time": time.time()}


def publish(store, record: dict[str, Any]) -> None:
    """Add a failure record to the job's log in `store` (a PrefixStore on key_prefix())."""
    # Appended first, counted second: a reader that sees the count finds the record.
    store.append(FAILURE_LOG, json.dumps(record) + "\n")
    store.add(FAILURE_COUNT, 1)


def failure_count(store) -> int:
    return int(store.add(FAILURE_COUNT, 0))


def read_failures(store) -> tuple[list[dict[str, Any]], list[str]]:
    """(every failure record published so far, oldest first; what was wrong with each line of the log that is not a
    record). A bad line is skipped, not fatal: the records after it still count."""
    records, bad = [], []
    for number, line in enumerate(store.get(FAILURE_LOG).splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(parse_record(line, FAILURE_FIELDS, f"line {number} of the failure log"))
        except RecordError as exc:
            bad.append(str(exc))
    return records, bad


def format_failure(record: dict[str, Any], seen_by: int | None = None) -> str:
    """The one line printed for a failure record."""
    notes = [f"step {record['step']}"]
    if seen_by is not None and seen_by != record["rank"]:
        notes.append(f"seen by rank {seen_by}")
    return (f"hpc_rlhf: rank {record['rank']} (role {record['role']}) {record['kind']} during {record['phase']}: "
            f"{record['detail']} [{'; '.join(notes)}]")


# ---------------------------------------------------------------------------------------------- the disk
def record_failure(message: str, env: Mapping[str, str] | None = None) -> None:
    """Write why and when this rank failed to its error file, if its launcher gave it one (a no-op otherwise)."""
    path = (os.environ if env is None else env).get(ERROR_FILE_VAR)
    if path:
        try:
            Path(path).write_text(json.dumps({"time": time.time(), "message": message}))
        except OSError:
            pass  # reporting must not hide the error being reported


def read_recorded_failure(path: Path) -> tuple[float, str] | None:
    """(unix time, message) of a rank's error file, or None if it wrote none (or a broken one)."""
    try:
        record = json.loads(path.read_text())
        return float(record["time"]), str(record["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
