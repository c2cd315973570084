"""The job's rendezvous store, served by a process of its own on rank 0's node, so that it outlives rank 0.

Why: the TCPStore at MASTER_ADDR:MASTER_PORT is where the ranks meet, and afterwards where the watchdog keeps
its heartbeats and failure records (hpc_rlhf.dist.watchdog; their format: hpc_rlhf.dist.liveness). Under
torchrun the agent serves it; under srun, mpirun and the local launcher torch would serve it from inside rank 0,
so anything that ended rank 0 took the records with it:
- a rank 0 killed in its training loop could only be named, not placed: its peers had last read its heartbeat a
  beat before it entered the phase it died in;
- when another rank died, srun's --kill-on-bad-exit SIGTERMs every task; a rank 0 that died of it took the
  store before the other ranks had read the failure record, and some of them then blamed rank 0.

So rank 0 forks this small process before it joins the world (`start`), and is a client of it like every other
rank. The process ignores the launchers' SIGTERM/SIGINT and serves while rank 0 lives. When rank 0 is gone (or
says it is done: `StoreHost.close`), it
- publishes rank 0's failure if rank 0's last heartbeat says it was still running: rank 0 ended without a word
  (killed), and the record names its role, phase and step for every rank, on every node, within one beat;
- serves on until every rank has stopped, failed, been terminated or gone quiet (no heartbeat for QUIET_S),
  at most LINGER_MAX_S, then exits. A rank 0 that died before its watchdog started has no heartbeat: the
  store then closes at once, so that ranks still joining fail at once instead of waiting for their timeout.
Slurm's end of the step (SIGKILL) ends it too.

It listens on the address the ranks connect to only (`listen_host`), and reads the job's keys through the job's
secret (hpc_rlhf.dist.store_guard): a close key or a record that another process wrote is not the job's.

Forked, not started afresh: a new interpreter would import torch again (2-3 CPU seconds per job start); the
fork happens before rank 0 joins any process group, touches CUDA or initialises MPI, so the child inherits no
state it could break. It closes every inherited file descriptor, so that it holds no pipe of its launcher.
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

from hpc_rlhf.dist import liveness, store_guard

LOOPBACK = "127.0.0.1"
CLOSE_KEY = "hpc_rlhf/store_host/close"
POLL_S = 0.1
QUIET_S = 5.0        # a live rank beats at least once a second (failures.default_interval)
LINGER_MAX_S = 60.0
READY_TIMEOUT_S = 60.0
IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class StoreHostError(RuntimeError):
    """The store process could not serve at the port asked for; the message says why."""


@dataclass
class StoreHost:
    """The parent's handle: the process serving the store, and the port it listens on."""
    pid: int
    port: int

    def close(self, store) -> None:
        """Rank 0 is done with the store (`store`: a client of it): the process serves the others' last
        words, then exits (see the module docstring). No wait: it never holds rank 0 up."""
        try:
            store.set(CLOSE_KEY, "1")
        except Exception:  # noqa: BLE001 - the process may be gone already; nothing is lost then
            pass
        self.reap()

    def reap(self) -> None:
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def listen_host(master_addr: str, one_node: bool) -> str:
    """The address the store listens on: the one the ranks connect to (MASTER_ADDR, resolved here), so that it is
    not reachable through the node's other interfaces. A name that resolves to loopback here (Debian's hosts file
    maps the host's own name to 127.0.1.1) is loopback for the other nodes only by accident: in a job of several
    nodes the store then listens everywhere (""), as torch's own does."""
    try:
        resolved = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError, IndexError):
        return ""  # bootstrap names the address that does not resolve
    if ipaddress.ip_address(resolved.split("%")[0]).is_loopback and not one_node:
        return ""
    return resolved


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening at host:port for a TCPStore to serve on (torch's own binds every interface). An address
    that is not this host's (MASTER_ADDR names another interface or a NAT'd name) falls back to every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=4096)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL or not host:
            raise
    return socket.create_server(("", port), backlog=4096)


def start(port: int, world_size: int, timeout_s: float, secret: str, host: str = "") -> StoreHost:
    """Fork the store's process, serving at host:port (port 0: a free port the OS picks) and reading the job's
    keys with `secret` (hpc_rlhf.dist.store_guard); return once it listens."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    # No collection may run in the child before it has set the inherited objects aside: libraries' at-fork hooks
    # allocate in the child (filelock 4.3's resets its lock registry), and a collection there walked the parent's
    # whole heap and crashed once (segfault in the collector, 2026-11-30, the learning lane's pytest, whose other
    # threads were waiting on the shared models' runs). The child's collections then walk only its own objects.
    collecting = gc.isenabled()
    gc.disable()
    try:
        pid = os.fork()
    except BaseException:
        if collecting:
            gc.enable()
        raise
    if pid == 0:  # the store's process: never returns
        code = 0
        try:
            gc.freeze()
            if collecting:
                gc.enable()
            os.close(read_fd)
            _serve(host, port, world_size, timeout_s, secret, write_fd, parent)
        except BaseException:  # noqa: BLE001 - nothing to print to: stdout and stderr are closed
            code = 1
        finally:
            os._exit(code)  # no atexit handlers, no flushing of the parent's buffers
    if collecting:
        gc.enable()
    os.close(write_fd)
    try:
        answer = _read_answer(read_fd, READY_TIMEOUT_S)
    finally:
        os.close(read_fd)
    if not answer.startswith("ok "):
        if not answer:  # no word within the time: do not leave it behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(pid, 0)
        raise StoreHostError(answer.removeprefix("error ") or "its process ended before it listened")
    return StoreHost(pid, int(answer.split()[1]))


def _read_answer(fd: int, timeout_s: float) -> str:
    data, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


# ------------------------------------------------------------------------------------------ the process
def _detach(keep_fd: int) -> None:
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    try:
        max_fd = os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        max_fd = 65536
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, max_fd)


def _serve(host: str, port: int, world_size: int, timeout_s: float, secret: str, ready_fd: int,
           parent: int) -> None:
    import torch.distributed as dist

    _detach(ready_fd)
    try:
        listening = listen_socket(host, port)
        port = listening.getsockname()[1]
        raw = dist.TCPStore(host or LOOPBACK, port, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s), master_listen_fd=listening.detach())
    except Exception as exc:  # noqa: BLE001 - said to the parent, which raises it with the address
        os.write(ready_fd, f"error {' '.join(str(exc).split())[:400]}".encode())
        os.close(ready_fd)
        return
    os.write(ready_fd, f"ok {raw.port}".encode())
    os.close(ready_fd)

    store = store_guard.guarded(raw, secret)
    while os.getppid() == parent and store.get_if_sealed(CLOSE_KEY) is None:
        time.sleep(POLL_S)
    rank0_gone = os.getppid() != parent
    records = store_guard.guarded(raw, secret, liveness.key_prefix())
    beat0 = _heartbeat_or_none(records, 0)
    if beat0 is None:
        return  # rank 0 never started its watchdog: no one reads records; close so that joiners fail now
    if rank0_gone and beat0["state"] == liveness.RUNNING:
        liveness.publish(records, liveness.failure_record(
            0, beat0["role"], beat0["phase"], beat0["step"], "failed",
            f"its process (pid {beat0['pid']}) is gone (seen by the rendezvous store's process)",
            primary=True, by=-1))
    _linger(records, world_size)


def _heartbeat_or_none(records, rank: int) -> dict | None:
    """A rank's heartbeat; a value that is not one counts as none (the ranks' watchdogs report it)."""
    try:
        return liveness.read_heartbeat(records, rank)
    except liveness.RecordError:
        return None


def _linger(records, world_size: int) -> None:
    """Serve until no rank can still need the store: each has stopped, failed, been terminated, or beats no more."""
    last_seq: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + LINGER_MAX_S
    while time.monotonic() < deadline:
        now = time.monotonic()
        needed = False
        for rank in range(world_size):
            beat = _heartbeat_or_none(records, rank)
            if beat is None or beat["state"] != liveness.RUNNING:
                continue
            seq, since = last_seq.get(rank, (None, now))
            if seq != beat["seq"]:
                last_seq[rank] = (beat["seq"], now)
                since = now
            if now - since < QUIET_S:
                needed = True
        if not needed:
            return
        time.sleep(POLL_S)
