"""Join the one `torch.distributed` world of the job, the way this process was launched.

`init_distributed` reads the launch (hpc_rlhf.dist.launch_env.detect_launch: torchrun, srun, MPI or a single
process), completes it where the environment is not enough (under MPI: the master address and the node layout,
through mpi4py), exports RANK/WORLD_SIZE/... (DeepSpeed and torch read them), checks the world size the placement
needs, and calls `init_process_group` with a timeout, turning rendezvous failures into one sentence that names
the address and port. A single process still gets a 1-rank gloo world so that every code path (groups,
collectives, DeepSpeed) is the same with one rank or a thousand.

Why the rendezvous store is made here (`_rendezvous_store`), not by torch's env:// handler: ranks started with
different world sizes (a hand-written environment, two launch commands that disagree) would otherwise wait in
the process group's setup until the timeout and then say only that it timed out. Before the process group is
created, every rank writes the world size it was started with to the store (`_check_same_world_size`); a rank
whose value differs from rank 0's fails at once naming both values, and rank 0 names the ranks that never
arrived when the timeout ends its wait. Who serves the store: torchrun's agent under torchrun; under every other
launcher a small process that rank 0 forks first (hpc_rlhf.dist.store_host), so that the store, with the
watchdog's heartbeats and failure records, outlives rank 0 (`store_host_rank` says which for the watchdog).
Every rank sees the store through the job's secret (hpc_rlhf.dist.store_guard; `_store_secret` says where it
comes from), torch's own rendezvous keys included: the store given to init_process_group is the guarded one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Mapping

from hpc_rlhf.dist import store_guard, store_host
from hpc_rlhf.dist.devices import rank_device
from hpc_rlhf.dist.launch_env import (LOOPBACK, BootstrapError, LaunchInfo, detect_launch, layout_from_hostnames,
                                      uses_agent_store)
from hpc_rlhf.dist.placement import format_ranks

# ------------------------------------------------------------------------------------------------------ init
_CURRENT: LaunchInfo | None = None
_STORE = None        # this rank's client of the rendezvous store, while the world exists
_STORE_HOST = None   # on rank 0: its store process (store_host.StoreHost)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _complete_with_mpi(info: LaunchInfo, port_from_env: bool, secret: str | None) -> tuple[LaunchInfo, str | None]:
    """Ask MPI for the true rank/size, every rank's host, (unless given) rank 0's address and port, and rank 0's
    store secret (from the environment or made there): MPI is a channel of the job's own. Returns (info, secret)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise BootstrapError("launched by MPI (mpirun/mpiexec), which does not tell the master address, and "
                             "mpi4py is not installed to ask rank 0 for it: install mpi4py built against this "
                             "MPI, or set MASTER_ADDR and MASTER_PORT, or launch with srun or torchrun") from None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if (rank, size) != (info.rank, info.world_size):
        raise BootstrapError(f"MPI says rank {rank} of {size}, but the environment says rank {info.rank} of "
                             f"{info.world_size}")
    hosts_by_rank = comm.allgather(socket.gethostname())
    # The store is served on rank 0's host, so only rank 0 knows a port that is free there (its store process's).
    port = info.master_port if port_from_env else comm.bcast(
        (info.master_port or free_port("")) if rank == 0 else None, root=0)
    # Rank 0's, always: mpirun may hand the environment to the ranks of its own node only.
    secret = comm.bcast(secret if rank == 0 else None, root=0)
    layout = layout_from_hostnames(hosts_by_rank, rank)
    info = dataclasses.replace(info, master_addr=info.master_addr or hosts_by_rank[0], master_port=port, **layout)
    return info, secret


def _choose_backend(backend: str) -> str:
    import torch

    if backend not in ("auto", "gloo", "nccl"):
        raise BootstrapError(f"backend '{backend}' is not one of auto, gloo, nccl")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise BootstrapError("backend 'nccl' needs CUDA, but no CUDA device is available to torch here; "
                             "use backend 'gloo' or 'auto'")
    return backend


def _check_world_size(info: LaunchInfo, expected: int | None) -> None:
    if expected is not None and expected != info.world_size:
        raise BootstrapError(f"placement needs {expected} ranks but the job has {info.world_size} (launched by "
                             f"{info.launcher}): start {expected} ranks (srun --ntasks, torchrun --nnodes x "
                             f"--nproc_per_node, mpirun -np) or change the placement to fit {info.world_size}")


def _export(info: LaunchInfo, env: Mapping[str, str]) -> None:
    """Write the world into os.environ: torch's env:// rendezvous and DeepSpeed read it from there."""
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
                      LOCAL_WORLD_SIZE=str(info.local_world_size), GROUP_RANK=str(info.node_rank),
                      MASTER_ADDR=str(info.master_addr), MASTER_PORT=str(info.master_port))
    # Under torchrun the agent hosts the store and ranks only connect; anywhere else rank 0 must host it.
    if info.launcher == "torchrun" and "TORCHELASTIC_USE_AGENT_STORE" in env:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = env["TORCHELASTIC_USE_AGENT_STORE"]
    else:
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def _check_resolves(info: LaunchInfo) -> None:
    try:
        socket.getaddrinfo(info.master_addr, info.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise BootstrapError(f"the master address '{info.master_addr}' (launched by {info.launcher}) does not "
                             f"resolve on this host ({exc}); set MASTER_ADDR to a name or IP the nodes can reach")


def _describe_existing_world(env: Mapping[str, str]) -> LaunchInfo:
    import torch.distributed as dist

    try:
        info = detect_launch(env)
    except BootstrapError:
        info = LaunchInfo("single", 0, 1, 0, 1, 0, 1, LOOPBACK, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (info.rank, info.world_size):  # someone else made this world: assume one node
        info = dataclasses.replace(info, rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                                   node_rank=0, num_nodes=1, tasks_per_node=(world,))
    return info


def init_distributed(backend: str = "auto", timeout_s: float = 300, expected_world_size: int | None = None,
                     env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Join (or create) the job's world; return where this process sits in it. Safe to call twice.

    `env` is where the launch variables are read (default os.environ); os.environ is always updated, because
    torch and DeepSpeed read it. `timeout_s` bounds the rendezvous and every later collective.
    """
    global _CURRENT, _STORE, _STORE_HOST
    import torch.distributed as dist

    env = os.environ if env is None else env
    if dist.is_initialized():
        info = _CURRENT or _describe_existing_world(env)
        _check_world_size(info, expected_world_size)
        return info

    info = detect_launch(env)
    _check_world_size(info, expected_world_size)
    chosen = _choose_backend(backend)
    port_from_env = info.master_port is not None
    secret = _store_secret(info, env)
    if _store_served_apart(info, env) and info.rank == 0:
        # First of all: the fork must come before MPI, CUDA and process groups exist (see store_host).
        host = store_host.listen_host(info.master_addr or socket.gethostname(), _one_node(info))
        try:
            _STORE_HOST = store_host.start(info.master_port or 0, info.world_size, timeout_s, secret or "", host)
        except store_host.StoreHostError as exc:
            raise _cannot_form(info, chosen, timeout_s, exc) from exc
        info = dataclasses.replace(info, master_port=_STORE_HOST.port)
    try:
        info, store = _join(info, chosen, timeout_s, port_from_env, env, secret)
    except BaseException:
        # Whatever ended rank 0's setup before it had a store client (MPI, CUDA, the rendezvous): its store's
        # process leaves now, so that the other ranks fail at once instead of waiting for a world that will not
        # form. (A no-op when _join closed it already.)
        _close_store_host(None)
        raise
    _CURRENT, _STORE = info, store
    return info


def _join(info: LaunchInfo, chosen: str, timeout_s: float, port_from_env: bool, env: Mapping[str, str],
          secret: str | None):
    """The rest of init_distributed once rank 0's store process runs: MPI's answers, the CUDA device, the
    rendezvous store, the world size check and the default process group. Returns (info, store)."""
    import torch
    import torch.distributed as dist

    if info.launcher == "mpi":
        info, secret = _complete_with_mpi(info, port_from_env, secret)
    secret = _published_secret(info, secret)
    pick_port = info.master_port is None  # a one-rank world (single, or torchrun with WORLD_SIZE=1)
    if info.master_addr is None:
        info = dataclasses.replace(info, master_addr=LOOPBACK)

    if torch.cuda.is_available():  # through the GPUs Slurm made visible to this task (dist/devices.py)
        torch.cuda.set_device(rank_device(info.local_rank, info.local_world_size, torch.cuda.device_count()))

    attempts = 3 if pick_port else 1  # another process may take a picked port before the store binds it
    for attempt in range(attempts):
        if pick_port:
            info = dataclasses.replace(info, master_port=free_port(LOOPBACK))
        _check_resolves(info)
        _export(info, env)
        try:
            store = _rendezvous_store(info, timeout_s, secret)
            break
        except (RuntimeError, ValueError, OSError) as exc:  # torch's DistError is a RuntimeError
            if attempt + 1 < attempts:
                continue
            raise _cannot_form(info, chosen, timeout_s, exc) from exc
    try:
        if info.world_size > 1:
            _check_same_world_size(store, info, timeout_s)
        try:
            dist.init_process_group(chosen, store=store, rank=info.rank, world_size=info.world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise _cannot_form(info, chosen, timeout_s, exc) from exc
    except BaseException:
        _close_store_host(store)  # through the store: its process still serves the others' last words
        raise
    return info, store


def _cannot_form(info: LaunchInfo, backend: str, timeout_s: float, exc: BaseException) -> BootstrapError:
    reason = " ".join(str(exc).split())[:400]
    return BootstrapError(f"rank {info.rank} of {info.world_size} could not form the world at "
                          f"{info.master_addr or 'this host'}:{info.master_port} (launched by {info.launcher}, backend {backend}, "
                          f"timeout {timeout_s:g} s): {reason}")


def _store_served_apart(info: LaunchInfo, env: Mapping[str, str]) -> bool:
    """Whether rank 0 forks the store's process (store_host): in a world of several ranks without an agent."""
    return info.world_size > 1 and not (info.launcher == "torchrun" and uses_agent_store(env))


def _store_secret(info: LaunchInfo, env: Mapping[str, str]) -> str | None:
    """The job's store secret (hpc_rlhf.dist.store_guard) as far as this rank knows it before the rendezvous:
    the launcher's; or made here where no other rank needs to be told (a one-rank world) or where MPI will tell
    them (rank 0 under mpirun, `_complete_with_mpi`)."""
    secret = store_guard.secret_from_env(env)
    if secret is None and (info.world_size == 1 or (info.launcher == "mpi" and info.rank == 0)):
        secret = store_guard.make_secret()
    return secret


def _published_secret(info: LaunchInfo, secret: str | None) -> str:
    """The secret every part of this rank uses (the watchdog reads it from the environment). A job of several
    ranks started without one (srun or torchrun by hand) still runs, with a warning: its store is open."""
    if secret is None:
        if info.rank == 0:
            logging.getLogger("hpc_rlhf").warning(
                "%s is not set: any process that reaches the rendezvous store at %s:%s can write to it and steer "
                "this job (docs/failures.md, 'Who can steer a job'); the launchers of hpc_rlhf (sbatch/, "
                "hpc-rlhf submit, scripts/torchrun.sh, the local launcher, mpirun) set it",
                store_guard.SECRET_VAR, info.master_addr, info.master_port)
        return ""
    os.environ[store_guard.SECRET_VAR] = secret
    return secret


def _one_node(info: LaunchInfo) -> bool:
    return info.num_nodes == 1 and info.launcher != "mpi"  # MPI tells the layout after the store is up


def _rendezvous_store(info: LaunchInfo, timeout_s: float, secret: str):
    """A client of the TCPStore at MASTER_ADDR:MASTER_PORT, served by rank 0's store process or torchrun's agent
    (or, in a one-rank world without that agent, by this process), seen through the job's secret (store_guard).
    No rank waits for the others here: `_check_same_world_size` does, and says what is wrong."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if info.world_size == 1 and not (info.launcher == "torchrun" and uses_agent_store(os.environ)):
        listening = store_host.listen_socket(store_host.listen_host(info.master_addr, True), info.master_port)
        port = listening.getsockname()[1]
        # detach(): the store owns the descriptor from now on (the socket object would close it when collected)
        raw = dist.TCPStore(info.master_addr, port, is_master=True, wait_for_workers=False, timeout=timeout,
                            master_listen_fd=listening.detach())
    else:
        raw = dist.TCPStore(info.master_addr, info.master_port, is_master=False, wait_for_workers=False,
                            timeout=timeout)
    return store_guard.guarded(raw, secret)


def _close_store_host(store) -> None:
    """Tell rank 0's store process that rank 0 is done with it (a no-op on other ranks)."""
    global _STORE_HOST
    if _STORE_HOST is None:
        return
    if store is not None:
        _STORE_HOST.close(store)
    else:  # no rank could reach it: no one to wait for
        try:
            os.kill(_STORE_HOST.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _STORE_HOST.reap()
    _STORE_HOST = None


def store_host_rank() -> int | None:
    """The rank whose process serves the rendezvous store, or None when a process of its own does (torchrun's
    agent, or rank 0's store process): a world that init_distributed made has one of those."""
    return None if _CURRENT is not None or uses_agent_store(os.environ) else 0


WORLD_SIZE_KEY = "hpc_rlhf/bootstrap"
POLL_S = 0.05


def _check_same_world_size(store, info: LaunchInfo, timeout_s: float) -> None:
    """Every rank says which world size it was started with; see the module docstring.

    Rank 0 writes its own value where the others wait for it, and reads the values the others append to one
    log; another rank compares its value with rank 0's. A rank whose RANK is beyond rank 0's world is caught
    the same way, since it compares with rank 0's value too."""
    # torchrun's agent store serves every restart of the ranks: keep each attempt's keys apart.
    prefix = f"{WORLD_SIZE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    where = f"the rendezvous store at {info.master_addr}:{info.master_port} (launched by {info.launcher})"
    if info.rank != 0:
        store.append(f"{prefix}/joined", f"{info.rank}:{info.world_size}\n")
        try:
            store.wait([f"{prefix}/rank0"], timedelta(seconds=timeout_s))
        except (RuntimeError, TimeoutError) as exc:
            raise BootstrapError(f"rank {info.rank} of {info.world_size} waited {timeout_s:g} s at {where} for "
                                 f"rank 0 to say its world size, in vain: {' '.join(str(exc).split())[:200]}") from exc
        rank0_world = int(store.get(f"{prefix}/rank0"))
        if rank0_world != info.world_size:
            raise BootstrapError(_mismatch(info.rank, info.world_size, rank0_world, where))
        return
    store.set(f"{prefix}/rank0", str(info.world_size))
    deadline = time.monotonic() + timeout_s
    while True:
        joined = {}
        if store.check([f"{prefix}/joined"]):
            for line in store.get(f"{prefix}/joined").decode().split():
                rank, world = line.split(":")
                joined[int(rank)] = int(world)
        for rank, world in sorted(joined.items()):
            if world != info.world_size:
                raise BootstrapError(_mismatch(rank, world, info.world_size, where))
        missing = [r for r in range(1, info.world_size) if r not in joined]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise BootstrapError(f"rank 0 of {info.world_size} waited {timeout_s:g} s at {where} for the other "
                                 f"ranks; rank(s) {format_ranks(missing)} never arrived ({len(joined)} of "
                                 f"{info.world_size - 1} did): were they started, with the same MASTER_ADDR and "
                                 f"MASTER_PORT, and can they reach this address?")
        time.sleep(POLL_S)


def _mismatch(rank: int, world: int, rank0_world: int, where: str) -> str:
    return (f"rank {rank} was started with WORLD_SIZE={world} but rank 0 with WORLD_SIZE={rank0_world}, at {where}: "
            f"every rank of the job must be started with the same world size")


def current_launch() -> LaunchInfo | None:
    """What init_distributed returned, while the world exists."""
    return _CURRENT


def shutdown() -> None:
    """Leave the world (no collective: safe to call when other ranks have failed)."""
    global _CURRENT, _STORE
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _close_store_host(_STORE)
    _CURRENT, _STORE = None, None
