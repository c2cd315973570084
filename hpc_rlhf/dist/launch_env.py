"""How this process was launched, read from the environment alone: `detect_launch(env)`, a pure function.

It recognises, in this order:

1. torchrun (and the local launcher, which sets the same variables): RANK, WORLD_SIZE, LOCAL_RANK, ...
   It comes first because `srun torchrun ...` is common, and then the Slurm variables describe the torchrun
   agents, not the ranks.
2. An MPI launcher whose rank or size differs from Slurm's: `mpirun` inside an allocation starts its daemons
   with `srun`, so its ranks inherit the daemon step's SLURM_PROCID / SLURM_NTASKS, which are wrong for them.
3. A Slurm `srun` step, recognised by SLURM_STEP_ID. SLURM_PROCID alone is not enough: slurmstepd also sets
   SLURM_PROCID=0 for the batch script itself, and a batch script (or an `salloc` shell) is one process;
   Slurm's special step ids (batch, interactive, extern) do not count as an srun step either.
4. MPI (Open MPI, MPICH/Hydra PMI, PMIx). The environment does not name a master address there; it is filled
   in by `hpc_rlhf.dist.bootstrap.init_distributed` through mpi4py.
5. Otherwise a single process.

An inconsistent environment (a rank beyond the world size, a node list that does not expand, ...) raises
BootstrapError naming the variable. Nothing here talks to other processes or imports torch: joining the world is
hpc_rlhf.dist.bootstrap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from hpc_rlhf.dist.hostlist import expand_hostlist, parse_tasks_per_node

LAUNCHERS = ("slurm", "mpi", "torchrun", "single")
# The rendezvous port of a Slurm job without MASTER_PORT: 10000 + job id % 20000, i.e. 10000-29999, below Linux's
# ephemeral ports (32768-60999 by default), which a busy node hands out to outgoing connections and may already hold.
SLURM_PORT_BASE = 10000
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
    _check_below(name, "SLURM_LOCALID", local_rank, f"the tasks on node {node_rank} in {tasks_var or ntasks_var}",
                 local_world)

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


def layout_from_hostnames(hosts_by_rank: list[str], rank: int) -> dict:
    """Node layout implied by each rank's host name: nodes in order of first appearance."""
    nodes = list(dict.fromkeys(hosts_by_rank))
    mine = hosts_by_rank[rank]
    return dict(node_rank=nodes.index(mine), num_nodes=len(nodes),
                local_rank=hosts_by_rank[:rank].count(mine), local_world_size=hosts_by_rank.count(mine),
                hostnames=tuple(nodes), tasks_per_node=tuple(hosts_by_rank.count(h) for h in nodes))


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """torchrun's agent hosts the store (and outlives the ranks); the ranks are only its clients."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
