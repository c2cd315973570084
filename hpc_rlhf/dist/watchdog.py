"""Liveness of the job's ranks: heartbeats through the rendezvous store, so that no failure becomes a hang.

Why: when a rank dies or freezes, its peers block in their next collective. gloo gives up after dist.timeout_s
(minutes), only in ranks that talk to the lost one directly, and a frozen (SIGSTOPped) rank never even closes
its sockets; ranks of other roles wait on them in turn. A job that should have failed in seconds then holds
its allocation until the walltime. So every rank runs a small daemon thread that:

- every `interval` (1 s by default) writes its heartbeat `hb/<rank>` (sequence number, role, phase, step,
  host, pid, state) to the store and reads the heartbeats of the ranks it watches: the next 8 ranks on a ring,
  and rank 0. Every rank is watched by up to 8 others, and the store does O(1) operations per rank and beat;
- declares a watched rank failed when its process is gone (same host: seen at once from its pid), or when its
  heartbeat has not changed for `timeout_s` (a frozen process, a hung node). A frozen process on the same host
  is killed (SIGKILL) by the rank that found it, once that rank has reported it: a stopped process ignores the
  SIGTERM that launchers send first (torchrun then waits 30 s before its SIGKILL), so it would hold the job;
- publishes what it found as a failure record, as a rank whose run raised does (`report_failure`), and reads
  the record count every beat, so every rank learns of a failure within one interval;
- treats an unreachable store as the failure of the rank that hosts it (`store_host_rank`, passed in: rank 0 in
  a world that torch's env:// rendezvous made; None under hpc_rlhf's bootstrap, where the store has a process
  of its own, rank 0's store process or torchrun's agent, which outlives the ranks). A store that accepts a
  request but never answers (its host is frozen) is caught by a second thread that times the store operations.

On a failure the thread prints ONE line to stderr, naming the failed rank, its role and its phase,

    hpc_rlhf: rank 3 (role rollout) failed during scoring: its process (pid 4242) is gone [step 2; seen by rank 0]

records it for the local launcher (HPC_RLHF_ERROR_FILE) and ends the process with os._exit(1): the main thread
may be blocked inside a collective that will never return, so no orderly exit is possible. What a heartbeat and a
failure record hold, and where they live in the store, is hpc_rlhf.dist.liveness (the store's process and the
local launcher read them too).

Causes and consequences. When a rank is killed, the ranks in a collective with it fail at once with
"Connection closed by peer"; those failures are effects. `report_failure` publishes such communication
errors as secondary and waits a few beats for the cause (a rank seen dead, a primary failure); when one
arrives, the rank exits with the line that names the cause instead of its own traceback. Other ranks act on a
secondary record only if no cause appears within the same grace time. A rank that sees a timed-out collective while
it waits on something outside the job (its phase made by `waiting_on`: an environment server, a remote reward
endpoint) publishes itself as the cause, naming what it waits on: the others gave up waiting for it.

The store connection is a client of its own: the default store's client is used by the main thread to create
groups, which can block for minutes. Per step the recipes only call `phase()` and `set_step()`, which set two
attributes; all store traffic happens in the thread.

Timeout: `dist.heartbeat_timeout_s` (default 45 s, so that a frozen rank's job, reported and ended, is gone
within a minute; 0 turns the watchdog off), or the environment variable HPC_RLHF_HEARTBEAT_TIMEOUT_S, which
wins (handy to switch it off while a debugger holds a rank).

Length: this module is over 500 lines because `Watchdog` is one state machine (beat, judge, report, linger,
stop) whose two threads and the main thread share its state and locks; cut into modules, one decision would be
spread over several. What is not that state machine lives apart: its data (heartbeats, records, keys) in
dist/liveness.py, the step and phase it reports in dist/progress.py, its pure helpers (who watches whom, is a
process alive, is an exception a consequence) in dist/failures.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

from hpc_rlhf.dist import liveness, progress, store_guard
from hpc_rlhf.dist.failures import (_alive_a_moment_later, _pid_namespace, default_interval, describe_exception,
                                     exit_with_message, is_consequence, process_alive, watched_ranks)
from hpc_rlhf.dist.liveness import (FAILED, RUNNING, STOPPED, TERMINATED, failure_record, format_failure,
                                    key_prefix, publish)
from hpc_rlhf.dist.progress import (WAITING_ON, Progress, current_phase, current_step, phase,  # noqa: F401 (API)
                                    set_step, waiting_on)
from hpc_rlhf.utils import console, faults

log = logging.getLogger("hpc_rlhf")

HEARTBEAT_TIMEOUT_ENV = "HPC_RLHF_HEARTBEAT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 45.0


class _PeerView:
    __slots__ = ("rank", "beat", "seq", "changed_at")

    def __init__(self, rank: int, now: float):
        self.rank, self.beat, self.seq, self.changed_at = rank, None, None, now


# ============================================================================================= watchdog
class Watchdog:
    """One rank's watchdog. `store` is a Store only this object uses (a client connection of its own).

    store_host_rank: the rank whose process hosts the store (None: a process of its own, torchrun's agent or rank
    0's store process).
    roles: this rank's role names, or a function that returns them once they are known (None before: "trainer");
    roles are known only once the process groups exist, after the watchdog has started.
    on_fatal: called once with the line to print; the default prints it, kills a frozen peer that this rank
    found on its host (`frozen_peer_pid`) and ends the process.
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *, progress: Progress | None = None,
                 roles: Sequence[str] | Callable[[], Sequence[str] | None] | None = None,
                 interval_s: float | None = None,
                 store_host_rank: int | None = 0, store_address: str = "the rendezvous store",
                 on_fatal: Callable[[str], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = float(timeout_s)
        self.interval = interval_s or default_interval(self.timeout_s)
        self.grace = 3 * self.interval
        self.progress = progress or Progress()
        self.roles = None if roles is None or callable(roles) else list(roles) or None
        self._roles_of = roles if callable(roles) else None
        self.store_host_rank = store_host_rank
        self.store_address = store_address
        self.on_fatal = on_fatal or self._exit
        self.frozen_peer_pid: int | None = None  # a watched rank on this host that stopped responding
        self.host, self.pid, self.pidns = socket.gethostname(), os.getpid(), _pid_namespace()
        now = time.monotonic()
        self.peers = {r: _PeerView(r, now) for r in watched_ranks(rank, world_size, store_host_rank)}
        self.records: list[dict[str, Any]] = []  # every published failure, as last read
        self.reported: set[int] = set()          # peers this rank published a failure of
        self.bad_records: set[str] = set()       # store values that were not records, each reported once
        self.fatal_message: str | None = None
        self._records_read = 0
        self._seq = 0
        self._failing: str | None = None  # None, "primary" (own failure) or "secondary" (a peer's effect)
        self._effect_seen_at: float | None = None
        self._store_lock = threading.Lock()
        self._ops_in_flight: dict[int, float] = {}
        self._fatal_lock = threading.Lock()
        self._fatal_done = threading.Event()
        self._halt = threading.Event()      # ends the heartbeat thread (stop or fatal)
        self._stopped = threading.Event()   # ends the guard thread (stop only)
        self._stopping = False              # an orderly stop: say so in the last heartbeat
        self._terminated = False            # SIGTERM is ending this process (say_terminated)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------------------------------- store
    def _op(self, fn, *args, patient: bool = True):
        """One store operation, timed for the guard thread (a frozen store host never answers).

        patient=False: give up (TimeoutError) if another operation holds the connection for an interval;
        used by the courtesy writes of an exiting rank, which must not wait behind a stuck operation."""
        if not self._store_lock.acquire(timeout=-1 if patient else self.interval):
            raise TimeoutError("the watchdog's store connection is busy")
        me = threading.get_ident()
        self._ops_in_flight[me] = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._ops_in_flight.pop(me, None)
            self._store_lock.release()

    def role(self) -> str:
        if self.roles is None:
            names = self._roles_of() if self._roles_of is not None else None
            if names is None:
                return "trainer"
            self.roles = list(names) or ["none"]
        return "+".join(self.roles)

    def _write_own(self, state: str, patient: bool = True) -> None:
        if self._terminated:
            state = TERMINATED  # the last word, even if the thread was about to write another
        self._seq += 1
        beat = liveness.heartbeat(self._seq, self.role(), self.progress.name, self.progress.step, self.host,
                                  self.pid, self.pidns, state)
        self._op(self.store.set, liveness.heartbeat_key(self.rank), beat, patient=patient)

    def publish_now(self) -> None:
        """This rank's heartbeat, written at once from the calling thread."""
        self._write_own(FAILED if self._failing else RUNNING)

    def _publish(self, record: dict[str, Any]) -> None:
        self._op(publish, self.store, record)

    def _read_failures(self) -> None:
        count = self._op(liveness.failure_count, self.store)
        if count <= self._records_read:
            return
        self.records, bad = self._op(liveness.read_failures, self.store)
        for problem in bad:
            self._report_bad_record(problem)
        self._records_read = count
        # see _linger_for_readers
        self._op(self.store.set, liveness.seen_key(self.rank), str(self._records_read))

    def _report_bad_record(self, problem: str) -> None:
        """Once per problem: a record that does not parse is skipped, and the peers are still judged by their
        heartbeats (a watchdog that stopped at the first bad record would leave a frozen rank to dist.timeout_s)."""
        if problem not in self.bad_records:
            self.bad_records.add(problem)
            console.say(f"hpc_rlhf: rank {self.rank}: watchdog: skipped {problem} (the store holds something that "
                        f"is not a record of this job's ranks)")

    def _read_peer(self, peer: _PeerView, now: float) -> None:
        try:
            beat = self._op(liveness.read_heartbeat, self.store, peer.rank)
        except liveness.RecordError as exc:
            self._report_bad_record(str(exc))  # read as silence: judged by the time since its last good beat
            return
        if beat is None:
            return
        if beat["seq"] != peer.seq:
            peer.seq, peer.changed_at = beat["seq"], now
        peer.beat = beat

    # --------------------------------------------------------------------------------------------- beat
    def beat(self) -> None:
        """One round: publish, read, judge. The thread calls it every interval; tests call it directly."""
        self._write_own(FAILED if self._failing else RUNNING)
        self._read_failures()
        now = time.monotonic()
        for peer in self.peers.values():
            self._read_peer(peer, now)
        # Records first: a peer that exits because of a published failure is not a failure of its own.
        self._act_on_records(now)
        if self.fatal_message is None:
            self._judge_peers(now)

    def _is_local(self, beat: dict[str, Any]) -> bool:
        return beat["host"] == self.host and beat["pidns"] == self.pidns

    def _judge_peers(self, now: float) -> None:
        for peer in self.peers.values():
            beat = peer.beat
            if peer.rank in self.reported or (beat is not None and beat["state"] != RUNNING):
                continue  # it stopped in order, or it is failing and says so itself
            if beat is not None and self._is_local(beat) and not process_alive(beat["pid"]):
                self._read_peer(peer, now)  # it may have stopped in order a moment ago
                if peer.beat["state"] != RUNNING:
                    continue
                # Or another rank found it frozen, said so and killed it, since this beat read the records.
                self._read_failures()
                if self._causes():
                    self._act_on_records(now)
                else:
                    self._detected(peer, "failed", f"its process (pid {beat['pid']}) is gone")
                return
            silent = now - peer.changed_at
            if silent > self.timeout_s:
                detail = (f"no heartbeat for {silent:.0f} s (dist.heartbeat_timeout_s={self.timeout_s:g})"
                          if beat is not None else f"no heartbeat at all in {silent:.0f} s since the start")
                if beat is not None and self._is_local(beat):
                    # Still there (else the check above had caught it) but frozen: see the module docstring.
                    self.frozen_peer_pid = beat["pid"]
                    detail += f"; its process (pid {beat['pid']}) is still there: killed (SIGKILL)"
                self._detected(peer, "stopped responding", detail)
                return

    def _peer_record(self, peer: _PeerView, kind: str, detail: str) -> dict[str, Any]:
        beat = peer.beat or {}
        return failure_record(peer.rank, beat.get("role", "unknown"), beat.get("phase", "setup"),
                              beat.get("step", 0), kind, detail, primary=True, by=self.rank)

    def _detected(self, peer: _PeerView, kind: str, detail: str) -> None:
        record = self._peer_record(peer, kind, detail)
        self.reported.add(peer.rank)
        self._publish(record)
        self.records.append(record)
        if self._failing != "primary":
            self._fatal(format_failure(record, self.rank))

    def _causes(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["primary"] and r["by"] != self.rank]

    def _act_on_records(self, now: float) -> None:
        if self._failing == "primary":
            return  # this rank's own failure is being reported by its main thread
        causes = self._causes()
        if causes:
            self._fatal(format_failure(causes[0], self.rank))
            return
        effects = [r for r in self.records if r["by"] != self.rank]
        if not effects or self._failing == "secondary":
            return
        timed_out = [r for r in effects if "timed out" in r["detail"].lower() or "timeout" in r["detail"].lower()]
        if timed_out and WAITING_ON in self.progress.name:
            # Others' collectives timed out while this rank waits on an endpoint: it held them up, so it is the
            # cause to report, with what it waits on. (A lost connection is a dead rank's doing: not claimed.)
            record = failure_record(self.rank, self.role(), self.progress.name, self.progress.step,
                                    "held up the others", f"rank {timed_out[0]['rank']} gave up waiting for it "
                                    f"({timed_out[0]['detail']})", primary=True, by=self.rank)
            self._publish(record)
            self.records.append(record)
            self._fatal(format_failure(record, self.rank))
            return
        # Only effects so far: give the cause a few beats to show up before blaming an effect.
        self._effect_seen_at = self._effect_seen_at or now
        if now - self._effect_seen_at >= self.grace:
            self._fatal(format_failure(effects[0], self.rank))

    # ---------------------------------------------------------------------------------------- failures
    def _fatal(self, message: str, store_usable: bool = True) -> None:
        with self._fatal_lock:
            if self.fatal_message is not None:
                return
            self.fatal_message = message
        self._halt.set()
        if store_usable:
            try:  # peers must not take this exit for a failure of its own
                self._write_own(FAILED, patient=False)
            except Exception:  # noqa: BLE001 - a courtesy; the report must go on
                pass
            self._linger_for_readers()
        self.on_fatal(message)
        self._fatal_done.set()

    def _linger_for_readers(self) -> None:
        """On the store's host: wait (at most 2 x `grace`) until the other live ranks have read every failure
        record, since this process's exit takes the store and the records with it."""
        if self.store_host_rank != self.rank:
            return
        try:
            count = self._op(liveness.failure_count, self.store, patient=False)
            # The failed ranks and those that found a failure need no telling. A rank that published an
            # effect (a broken collective) is still waiting to read its cause.
            causes = [r for r in self.records if r["primary"]]
            informed = {r["rank"] for r in causes} | {r["by"] for r in causes} | {self.rank}
            waiting = [r for r in range(self.world_size) if r not in informed]
            deadline = time.monotonic() + 2 * self.grace
            while waiting and time.monotonic() < deadline:
                waiting = [r for r in waiting if self._records_seen_by(r) < count]
                time.sleep(self.interval / 4)
        except Exception:  # noqa: BLE001 - lingering is a courtesy; the report must go on
            pass

    def _records_seen_by(self, rank: int) -> int:
        key = liveness.seen_key(rank)
        if not self._op(self.store.check, [key], patient=False):
            return 0
        return int(self._op(self.store.get, key, patient=False))

    def _store_lost(self, exc: BaseException) -> None:
        """The store failed or stalled: report the cause if one is known, else blame the store's host."""
        if self._stopping or self._failing == "primary" or self.fatal_message is not None:
            self._halt.set()
            return
        causes = self._causes()
        if causes:
            self._fatal(format_failure(causes[0], self.rank), store_usable=False)
            return
        error = describe_exception(exc)
        host = self.store_host_rank
        peer = self.peers.get(host) if host is not None else None
        if peer is None:
            self._fatal(f"hpc_rlhf: the rendezvous store at {self.store_address} became unreachable during "
                        f"{self.progress.name} of rank {self.rank}: {error} [step {self.progress.step}]",
                        store_usable=False)
            return
        beat = peer.beat or {}
        if beat.get("state") in (STOPPED, TERMINATED):
            # Rank 0 finished, or its launcher is ending the job, and took the store with it: nothing to report.
            self._halt.set()
            return
        if beat.get("state") == FAILED:
            detail = (f"it failed or saw a failure, and its exit took down the rendezvous store it hosted at "
                      f"{self.store_address} before this rank read why (see rank {host}'s output)")
            kind = "failed"
        elif beat and self._is_local(beat) and not _alive_a_moment_later(beat["pid"], self.interval):
            detail = (f"its process (pid {beat['pid']}) is gone, and with it the rendezvous store it hosted at "
                      f"{self.store_address}")
            kind = "failed"
        else:
            detail = f"the rendezvous store it hosts at {self.store_address} is unreachable ({error})"
            kind = "stopped responding"
        self._fatal(format_failure(self._peer_record(peer, kind, detail), self.rank), store_usable=False)

    def report_failure(self, exc: BaseException) -> None:
        """Publish this rank's failure (called by the main thread with the exception that ends the run).

        A communication error (the effect of a peer's failure) waits a few beats for the cause: if one
        arrives, the process ends with the line naming it. The store's host waits until the others have read
        the record (bounded), since its exit takes the store down.
        """
        if self.fatal_message is not None:
            self._fatal_done.wait()
            return
        secondary = is_consequence(exc)
        self._failing = "secondary" if secondary else "primary"
        record = failure_record(self.rank, self.role(), self.progress.name, self.progress.step, "failed",
                                describe_exception(exc), primary=not secondary, by=self.rank)
        try:
            self._write_own(FAILED)
            self._publish(record)
        except Exception as store_exc:  # noqa: BLE001 - the store's host is gone: that may be the cause
            if secondary:
                self._store_lost(store_exc)
            return
        deadline = time.monotonic() + self.grace
        while secondary and time.monotonic() < deadline and self.fatal_message is None:
            time.sleep(self.interval / 4)  # the watchdog thread ends the process if a cause shows up
        if self.fatal_message is not None:
            self._fatal_done.wait()  # the watchdog thread is reporting the cause and ending the process
            return
        self._linger_for_readers()

    # -------------------------------------------------------------------------------------------- threads
    def start(self) -> "Watchdog":
        self._write_own(RUNNING)  # at once, so that peers see this rank before its first interval ends
        for target, name in ((self._run, "hpc_rlhf-watchdog"), (self._guard, "hpc_rlhf-watchdog-guard")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self) -> None:
        from torch.distributed import DistError

        warned = False
        while not self._halt.wait(self.interval):
            try:
                self.beat()
            except (DistError, OSError) as exc:
                self._store_lost(exc)
                return
            except Exception:  # noqa: BLE001 - a bug here must not end the training run
                if not warned:
                    log.exception("watchdog: unexpected error (liveness checks continue)")
                    warned = True
        if self._stopping and self.fatal_message is None:
            try:
                self._write_own(STOPPED)
            except Exception:  # noqa: BLE001
                pass

    def _guard(self) -> None:
        """Times the store operations of both threads: an answer that never comes is a frozen store host."""
        while not self._stopped.wait(self.interval / 2):
            started = min(list(self._ops_in_flight.values()), default=None)
            if started is None or time.monotonic() - started <= self.timeout_s:
                continue
            if self.fatal_message is None:
                self._store_lost(TimeoutError(f"no answer for {self.timeout_s:g} s"))
            elif not self._fatal_done.is_set():
                self.on_fatal(self.fatal_message)  # the exit's courtesy writes are stuck: exit anyway
            return

    def stop(self) -> None:
        """Orderly end: the last heartbeat says 'stopped', so peers stop watching this rank. Bounded."""
        if self._stopped.is_set():
            return
        self._stopping = True
        self._halt.set()
        self._stopped.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval + 1)
        if self.store_host_rank == self.rank and self.fatal_message is None:
            self._wait_for_peers_to_stop()

    def _exit(self, message: str) -> None:
        exit_with_message(message, end_pid=self.frozen_peer_pid)

    def say_terminated(self) -> None:
        """The last heartbeat of a rank that SIGTERM is about to end: its peers must not take that for a failure."""
        self._terminated = True
        try:
            self._write_own(TERMINATED, patient=False)
        except Exception:  # noqa: BLE001 - a courtesy; the signal's default action goes on
            pass

    def await_cause(self) -> None:
        """Give the running watchdog `grace` to find the failure that made the launcher send SIGTERM (a peer
        that died a moment ago): if it does, it ends the process with the line naming it, so that every rank's
        output says why the job ended. Else return: the caller lets the signal end the process."""
        if self._threads and not self._halt.is_set():
            self._fatal_done.wait(self.grace)
        self._halt.set()

    def _wait_for_peers_to_stop(self) -> None:
        """On the store's host: leave only once the others' watchdogs have stopped too (at most 2 x `grace`),
        or they would take the store vanishing with this process for its failure (e.g. when every rank exits
        after a preemption checkpoint, with no barrier after the last step)."""
        deadline = time.monotonic() + 2 * self.grace
        waiting = [r for r in range(self.world_size) if r != self.rank]
        try:
            while waiting and time.monotonic() < deadline:
                waiting = [rank for rank in waiting
                           if (self._op(liveness.read_heartbeat, self.store, rank, patient=False) or {}).get("state")
                           == RUNNING]
                if waiting:
                    time.sleep(self.interval / 4)
        except Exception:  # noqa: BLE001 - a courtesy: the exit goes on
            pass


# ============================================================================================= module API
_ACTIVE: Watchdog | None = None
_ATEXIT_REGISTERED = False


def heartbeat_timeout(cfg: Any = None) -> float:
    """HPC_RLHF_HEARTBEAT_TIMEOUT_S if set, else cfg.dist.heartbeat_timeout_s, else 45 s (0 = off)."""
    raw = os.environ.get(HEARTBEAT_TIMEOUT_ENV, "").strip()
    if raw:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    return float(getattr(getattr(cfg, "dist", None), "heartbeat_timeout_s", DEFAULT_TIMEOUT_S))


def store_address() -> tuple[str, int] | None:
    """Host and port of the TCPStore that init_process_group used (None if it used another kind of store)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # init_process_group wraps it in PrefixStores
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port and port.isdigit() else None


def start(role_names: Sequence[str] | Callable[[], Sequence[str] | None] | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S, *, store_host_rank: int | None,
          interval_s: float | None = None) -> Watchdog | None:
    """Start this rank's watchdog (every rank of the world calls it). Returns None where there is nothing to
    watch: a one-rank world, a timeout of 0, or a world without a TCP rendezvous store.

    role_names: as Watchdog's `roles`. store_host_rank: the rank whose process serves the rendezvous store, or
    None when a process of its own does (hpc_rlhf.dist.bootstrap.store_host_rank() says which)."""
    global _ACTIVE, _ATEXIT_REGISTERED
    import torch.distributed as dist

    stop()
    progress.reset()
    faults.active()  # a malformed HPC_RLHF_FAULT fails here, before the first step
    if timeout_s <= 0 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    address = store_address()
    if address is None:
        log.warning("watchdog: no TCP rendezvous store found; rank failures are detected by collective "
                    "timeouts only")
        return None
    host, port = address
    client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    records = store_guard.guarded(client, store_guard.secret_from_env() or "", key_prefix())  # bootstrap published it
    _ACTIVE = Watchdog(records, dist.get_rank(), dist.get_world_size(), timeout_s,
                       progress=progress.current(), roles=role_names, interval_s=interval_s,
                       store_host_rank=store_host_rank, store_address=f"{host}:{port}")
    if not _ATEXIT_REGISTERED:
        atexit.register(stop)  # a normal exit must not look like a death to the peers
        _ATEXIT_REGISTERED = True
    progress.before_fault(_ACTIVE.publish_now)  # an injected death is reported with the phase it happened in
    _note_sigterm()
    return _ACTIVE.start()


def _note_sigterm() -> None:
    """Until the recipe installs its own SIGTERM handler (a stop request, runtime.checkpointing.StopSignal), SIGTERM
    ends a rank at once (its default action). That is what a launcher sends every other rank when one has died
    (torchrun does so within 0.1 s), and a rank still setting up dies of it. Its peers would then find two
    ranks gone and could blame the wrong one. So the rank says 'terminated' in its last heartbeat, waits a few
    beats for the watchdog to find the failure behind the signal (and to end the process with the line naming
    it), and else dies of the signal as it would have."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread can install a handler (e.g. a test runner's worker thread)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, _frame) -> None:
    if _ACTIVE is not None:
        _ACTIVE.say_terminated()
        _ACTIVE.await_cause()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def report_failure(exc: BaseException) -> None:
    """Tell the other ranks that this rank's run failed with `exc` (no-op without a watchdog)."""
    if _ACTIVE is not None:
        _ACTIVE.report_failure(exc)


def active() -> Watchdog | None:
    return _ACTIVE


def stop() -> None:
    """Stop this rank's watchdog in order (call before the final barrier: rank 0's exit ends the store)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop()
        _ACTIVE = None
        progress.before_fault(None)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
