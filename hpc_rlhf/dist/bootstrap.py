"""Find out how this process was launched and join the one `torch.distributed` world of the job.

`detect_launch(env)` is a pure function of the environment; it recognises, in this order:

1. torchrun (and the local launcher, which sets the same variables): RANK, WORLD_SIZE, LOCAL_RANK, ...
   It comes first because `srun torchrun ...` is common, and then the Slurm variables describe the torchrun
   agents, not the ranks.
2. An MPI launcher whose rank or size differs from Slurm's: `mpirun` inside an allocation starts its daemons
   with `srun`, so its ranks inherit the daemon step's SLURM_PROCID / SLURM_NTASKS, which are wrong for them.
3. A Slurm `srun` step, recognised by SLURM_STEP_ID. SLURM_PROCID alone is not enough: slurmstepd also sets
   SLURM_PROCID=0 for the batch script itself, and a batch script (or an `salloc` shell) is one process;
   Slurm's special step ids (batch, interactive, extern) do not count as an srun step either.
4. MPI (Open MPI, MPICH/Hydra PMI, PMIx). The environment does not name a master address there; it is filled
   in by `init_distributed` through mpi4py.
5. Otherwise a single process.

`init_distributed` then exports RANK/WORLD_SIZE/... (DeepSpeed and torch read them), checks the world size the
placement needs, and calls `init_process_group` with a timeout, turning rendezvous failures into one sentence
that names the address and port. A single process still gets a 1-rank gloo world so that every code path
(groups, collectives, DeepSpeed) is the same with one rank or a thousand.

Why the rendezvous store is made here (`_rendezvous_store`), not by torch's env:// handler: ranks started with
different world sizes (a hand-written environment, two launch commands that disagree) would otherwise wait in
the process group's setup until the timeout and then say only that it timed out. Before the process group is
created, every rank writes the world size it was started with to the store (`_check_same_world_size`); a rank
whose value differs from rank 0's fails at once naming both values, and rank 0 names the ranks that never
arrived when the timeout ends its wait. Who serves the store: torchrun's agent under torchrun; under every other
launcher a small process that rank 0 forks first (hpc_rlhf.dist.store_host), so that the store, with the
watchdog's heartbeats and failure records, outlives rank 0.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

from hpc_rlhf.dist.hostlist import expand_hostlist, parse_tasks_per_node

LAUNCHERS = ("slurm", "mpi", "torchrun", "single")
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000
SLURM_SPECIAL_STEP_IDS = 0xFFFFFFF0
LOOPBACK = "127.0.0.1"


class BootstrapError(RuntimeError):
    """The launch environment is inconsistent, or the world could not be formed; the message says which."""


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job. `master_addr`/`master_port` are None until known (MPI, single)."""
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    hostnames: tuple[str, ...] = ()
    # Ranks on each node, in node order, when the launcher says so (Slurm, MPI after init); else empty.
    tasks_per_node: tuple[int, ...] = ()

    @property
    def ranks_per_node(self) -> int | None:
        """The number of ranks on every node, or None when nodes hold different numbers of ranks."""
        counts = self.tasks_per_node
        if counts:
            return counts[0] if all(c == counts[0] for c in counts) else None
        if self.local_world_size * self.num_nodes == self.world_size:
            return self.local_world_size
        return None


# ---------------------------------------------------------------------------------------- reading variables
def _int(env: Mapping[str, str], name: str, launcher: str, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise BootstrapError(f"launch environment ({launcher}): {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise BootstrapError(f"launch environment ({launcher}): {name}={value} must be at least {minimum}")
    return value


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The first of `names` that is set, so that callers can name it in messages."""
    return next((n for n in names if env.get(n, "").strip() != ""), None)


def _port(env: Mapping[str, str], name: str, launcher: str) -> int:
    raw = env[name]
    try:
        port = int(raw.strip())
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise BootstrapError(f"launch environment ({launcher}): {name}={raw!r} is not a TCP port (1-65535)")
    return port


def _check_below(launcher: str, what: str, value: int, limit_what: str, limit: int) -> None:
    if value >= limit:
        bound = f"{limit_what}={limit}" if limit_what.isidentifier() else f"{limit} ({limit_what})"
        raise BootstrapError(f"launch environment ({launcher}): {what}={value} is not below {bound}")


# -------------------------------------------------------------------------------------------------- torchrun
def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    name = "torchrun"
    if "RANK" not in env:
        raise BootstrapError(f"launch environment ({name}): WORLD_SIZE={env['WORLD_SIZE']!r} is set but RANK is "
                             f"not; set both (torchrun does) or neither")
    if "WORLD_SIZE" not in env:
        raise BootstrapError(f"launch environment ({name}): RANK={env['RANK']!r} is set but WORLD_SIZE is not; "
                             f"set both (torchrun does) or neither")
    rank = _int(env, "RANK", name)
    world = _int(env, "WORLD_SIZE", name, minimum=1)
    _check_below(name, "RANK", rank, "WORLD_SIZE", world)
    # Hand-made environments often set only RANK/WORLD_SIZE: then assume one node.
    local_world = _int(env, "LOCAL_WORLD_SIZE", name, minimum=1) if "LOCAL_WORLD_SIZE" in env else world
    local_rank = _int(env, "LOCAL_RANK", name) if "LOCAL_RANK" in env else rank % local_world
    _check_below(name, "LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world)
    if local_world > world:
        raise BootstrapError(f"launch environment ({name}): LOCAL_WORLD_SIZE={local_world} is larger than "
                             f"WORLD_SIZE={world}")
    num_nodes = (_int(env, "GROUP_WORLD_SIZE", name, minimum=1) if "GROUP_WORLD_SIZE" in env
                 else -(-world // local_world))
    node_rank = _int(env, "GROUP_RANK", name) if "GROUP_RANK" in env else rank // local_world
    _check_below(name, "GROUP_RANK", node_rank, "the number of nodes", num_nodes)
    if world > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(var, "").strip():
                raise BootstrapError(f"launch environment ({name}): WORLD_SIZE={world} but {var} is not set")
    master_addr = env.get("MASTER_ADDR", "").strip() or LOOPBACK
    master_port = _port(env, "MASTER_PORT", name) if env.get("MASTER_PORT", "").strip() else None
    per_node = (local_world,) * num_nodes if local_world * num_nodes == world else ()
    return LaunchInfo(name, rank, world, local_rank, local_world, node_rank, num_nodes, master_addr, master_port,
                      (), per_node)


# ----------------------------------------------------------------------------------------------------- Slurm
def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    name = "slurm"
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "SLURM_PROCID" not in env:
        raise BootstrapError(f"launch environment ({name}): SLURM_STEP_ID={step} says this is an srun step, but "
                             f"SLURM_PROCID is not set")
    ntasks_var = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    if ntasks_var is None:
        raise BootstrapError(f"launch environment ({name}): inside an srun step but none of SLURM_STEP_NUM_TASKS, "
                             f"SLURM_NTASKS, SLURM_NPROCS is set")
    if "SLURM_LOCALID" not in env:
        raise BootstrapError(f"launch environment ({name}): inside an srun step but SLURM_LOCALID is not set")
    rank = _int(env, "SLURM_PROCID", name)
    world = _int(env, ntasks_var, name, minimum=1)
    _check_below(name, "SLURM_PROCID", rank, ntasks_var, world)
    local_rank = _int(env, "SLURM_LOCALID", name)

    # In a step, SLURM_NODELIST (and SLURM_STEP_NODELIST) list the step's nodes, which may be fewer than the job's.
    list_var = _first(env, ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"))
    if list_var is None:
        raise BootstrapError(f"launch environment ({name}): none of SLURM_STEP_NODELIST, SLURM_NODELIST, "
                             f"SLURM_JOB_NODELIST is set, so the master node is unknown")
    try:
        hosts = tuple(expand_hostlist(env[list_var]))
    except ValueError as exc:
        raise BootstrapError(f"launch environment ({name}): {list_var} does not expand: {exc}") from None
    num_nodes = len(hosts)
    if "SLURM_NODEID" in env:
        node_rank = _int(env, "SLURM_NODEID", name)
    elif num_nodes == 1:
        node_rank = 0
    else:
        raise BootstrapError(f"launch environment ({name}): {num_nodes} nodes in {list_var} but SLURM_NODEID "
                             f"is not set")
    _check_below(name, "SLURM_NODEID", node_rank, f"the number of hosts in {list_var}", num_nodes)

    tasks_var = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if tasks_var is not None:
        try:
            per_node = tuple(parse_tasks_per_node(env[tasks_var]))
        except ValueError as exc:
            raise BootstrapError(f"launch environment ({name}): {tasks_var} does not parse: {exc}") from None
        if len(per_node) != num_nodes or sum(per_node) != world:
            raise BootstrapError(f"launch environment ({name}): {tasks_var}={env[tasks_var]!r} gives "
                                 f"{sum(per_node)} tasks on {len(per_node)} nodes, but {ntasks_var}={world} and "
                                 f"{list_var} has {num_nodes} nodes")
    elif num_nodes == 1:
        per_node = (world,)
    else:
        raise BootstrapError(f"launch environment ({name}): {num_nodes} nodes but SLURM_TASKS_PER_NODE is not "
                             f"set, so the ranks per node are unknown")
    local_world = per_node[node_rank]
    _check_below(name, "SLURM_LOCALID", local_rank, f"the tasks on node {node_rank} in {tasks_var or ntasks_var}", local_world)

    # An explicit MASTER_ADDR/MASTER_PORT wins: sites often need a specific (InfiniBand) host name or port.
    master_addr = env.get("MASTER_ADDR", "").strip() or hosts[0]
    if env.get("MASTER_PORT", "").strip():
        master_port = _port(env, "MASTER_PORT", name)
    elif env.get("SLURM_JOB_ID", "").strip():
        # Same on every rank without communication; different for jobs that share a master node.
        master_port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", name) % SLURM_PORT_SPAN
    else:
        raise BootstrapError(f"launch environment ({name}): neither MASTER_PORT nor SLURM_JOB_ID is set, so "
                             f"the rendezvous port is unknown")
    return LaunchInfo(name, rank, world, local_rank, local_world, node_rank, num_nodes, master_addr, master_port,
                      hosts, per_node)


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """An srun task step, not the batch script, an interactive `salloc` step or the extern step."""
    step_var = _first(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
    if step_var is None:
        return False
    step = _int(env, step_var, "slurm", minimum=-2**31)
    # Slurm numbers those special steps from 0xFFFFFFF0 up (printed as negative by older versions).
    return 0 <= step < SLURM_SPECIAL_STEP_IDS


# ------------------------------------------------------------------------------------------------------- MPI
# (rank variable, size variables, local rank variable, local size variable) per MPI flavour, in order.
_MPI_FLAVOURS = (
    ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", ("PMI_SIZE",), "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    # PMIx exports the rank but not the size; Open MPI and PMI-compatible launchers export it beside.
    ("PMIX_RANK", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), None, None),
)


def _mpi_flavour(env: Mapping[str, str]):
    for flavour in _MPI_FLAVOURS:
        if flavour[0] in env:
            return flavour
    for flavour in _MPI_FLAVOURS[:2]:  # a size without its rank: _from_mpi names the missing rank
        if flavour[1][0] in env:
            return flavour
    return None


def _from_mpi(env: Mapping[str, str]) -> LaunchInfo:
    name = "mpi"
    rank_var, size_vars, local_var, local_size_var = _mpi_flavour(env)
    size_var = _first(env, size_vars)
    if rank_var not in env:
        raise BootstrapError(f"launch environment ({name}): {size_vars[0]} is set but {rank_var} is not")
    if size_var is None:
        raise BootstrapError(f"launch environment ({name}): {rank_var}={env[rank_var]!r} is set but no world size "
                             f"({' or '.join(size_vars)}); start the job with mpirun or srun")
    rank = _int(env, rank_var, name)
    world = _int(env, size_var, name, minimum=1)
    _check_below(name, rank_var, rank, size_var, world)
    if local_var and local_var in env and local_size_var in env:
        local_rank = _int(env, local_var, name)
        local_world = _int(env, local_size_var, name, minimum=1)
        _check_below(name, local_var, local_rank, local_size_var, local_world)
    else:
        local_rank, local_world = rank, world
    # Provisional layout (ranks filled node by node); init_distributed replaces it with the gathered host names.
    node_rank, num_nodes = rank // local_world, -(-world // local_world)
    master_addr = env.get("MASTER_ADDR", "").strip() or None
    master_port = _port(env, "MASTER_PORT", name) if env.get("MASTER_PORT", "").strip() else None
    return LaunchInfo(name, rank, world, local_rank, local_world, node_rank, num_nodes, master_addr, master_port)


def _mpi_disagrees_with_slurm(env: Mapping[str, str]) -> bool:
    """True when an MPI launcher's rank/size differ from the Slurm step's (mpirun inside an allocation)."""
    flavour = _mpi_flavour(env)
    if flavour is None:
        return False
    rank_var, size_vars = flavour[0], flavour[1]
    size_var = _first(env, size_vars)
    slurm_size_var = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    mpi_pairs = [(env.get(rank_var), env.get("SLURM_PROCID"))]
    if size_var is not None:
        mpi_pairs.append((env.get(size_var), env.get(slurm_size_var) if slurm_size_var else None))
    return any(a is None or b is None or a.strip() != b.strip() for a, b in mpi_pairs)


# ---------------------------------------------------------------------------------------------------- detect
def detect_launch(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """How this process was started, from the environment alone. Raises BootstrapError if it is inconsistent."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if _in_slurm_step(env):
        if _mpi_disagrees_with_slurm(env):
            return _from_mpi(env)
        return _from_slurm(env)
    if _mpi_flavour(env) is not None:
        return _from_mpi(env)
    return LaunchInfo("single", 0, 1, 0, 1, 0, 1, LOOPBACK, None)


# ------------------------------------------------------------------------------------------------------ init
_CURRENT: LaunchInfo | None = None
_STORE = None        # this rank's client of the rendezvous store, while the world exists
_STORE_HOST = None   # on rank 0: its store process (store_host.StoreHost)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def layout_from_hostnames(hosts_by_rank: list[str], rank: int) -> dict:
    """Node layout implied by each rank's host name: nodes in order of first appearance."""
    nodes = list(dict.fromkeys(hosts_by_rank))
    mine = hosts_by_rank[rank]
    return dict(node_rank=nodes.index(mine), num_nodes=len(nodes),
                local_rank=hosts_by_rank[:rank].count(mine), local_world_size=hosts_by_rank.count(mine),
                hostnames=tuple(nodes), tasks_per_node=tuple(hosts_by_rank.count(h) for h in nodes))


def _complete_with_mpi(info: LaunchInfo, port_from_env: bool) -> LaunchInfo:
    """Ask MPI for the true rank/size, every rank's host, and (unless given) rank 0's address and port."""
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
    layout = layout_from_hostnames(hosts_by_rank, rank)
    return dataclasses.replace(info, master_addr=info.master_addr or hosts_by_rank[0], master_port=port, **layout)


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
    if _store_served_apart(info, env) and info.rank == 0:
        # First of all: the fork must come before MPI, CUDA and process groups exist (see store_host).
        from hpc_rlhf.dist import store_host

        try:
            _STORE_HOST = store_host.start(info.master_port or 0, info.world_size, timeout_s)
        except store_host.StoreHostError as exc:
            raise _cannot_form(info, chosen, timeout_s, exc) from exc
        info = dataclasses.replace(info, master_port=_STORE_HOST.port)
    try:
        info, store = _join(info, chosen, timeout_s, port_from_env, env)
    except BaseException:
        # Whatever ended rank 0's setup before it had a store client (MPI, CUDA, the rendezvous): its store's
        # process leaves now, so that the other ranks fail at once instead of waiting for a world that will not
        # form. (A no-op when _join closed it already.)
        _close_store_host(None)
        raise
    _CURRENT, _STORE = info, store
    return info


def _join(info: LaunchInfo, chosen: str, timeout_s: float, port_from_env: bool, env: Mapping[str, str]):
    """The rest of init_distributed once rank 0's store process runs: MPI's answers, the CUDA device, the
    rendezvous store, the world size check and the default process group. Returns (info, store)."""
    import torch
    import torch.distributed as dist

    if info.launcher == "mpi":
        info = _complete_with_mpi(info, port_from_env)
    pick_port = info.master_port is None  # a one-rank world (single, or torchrun with WORLD_SIZE=1)
    if info.master_addr is None:
        info = dataclasses.replace(info, master_addr=LOOPBACK)

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if info.local_rank >= count:
            raise BootstrapError(f"local rank {info.local_rank} on this node but only {count} CUDA devices are "
                                 f"visible; start at most {count} ranks per node")
        torch.cuda.set_device(info.local_rank)

    attempts = 3 if pick_port else 1  # another process may take a picked port before the store binds it
    for attempt in range(attempts):
        if pick_port:
            info = dataclasses.replace(info, master_port=free_port(LOOPBACK))
        _check_resolves(info)
        _export(info, env)
        try:
            store = _rendezvous_store(info, timeout_s)
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


def _uses_agent_store(env: Mapping[str, str]) -> bool:
    """torchrun's agent hosts the store (and outlives the ranks); the ranks are only its clients."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _store_served_apart(info: LaunchInfo, env: Mapping[str, str]) -> bool:
    """Whether rank 0 forks the store's process (store_host): in a world of several ranks without an agent."""
    return info.world_size > 1 and not (info.launcher == "torchrun" and _uses_agent_store(env))


def _rendezvous_store(info: LaunchInfo, timeout_s: float):
    """A client of the TCPStore at MASTER_ADDR:MASTER_PORT, served by rank 0's store process or torchrun's agent
    (or, in a one-rank world, by this process). No rank waits for the others here: `_check_same_world_size`
    does, and says what is wrong."""
    import torch.distributed as dist

    serve_here = info.world_size == 1
    return dist.TCPStore(info.master_addr, info.master_port, is_master=serve_here, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


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
    return None if _CURRENT is not None or _uses_agent_store(os.environ) else 0


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
            from hpc_rlhf.dist.placement import format_ranks

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
