"""Does a job fit an allocation? The placement on the allocation's ranks and nodes, the GPU memory of every rank
against the GPU's, and the host memory of every node against the node's (when it is given). Pure Python: no torch.

One check for every caller: `hpc-rlhf plan` (its inputs come from flags) and a training mode's `--dry-run` (its
inputs come from the config: hpc_rlhf.launch.dry_run). Each input carries the name the user gave it (a flag such
as `--adam-offload` or a key such as `train.adam_offload`), so a refusal is one line that names what to change.

    report = check_allocation(placement, Allocation(32, 8, 80.0), loads)   # raises AllocationError
    reason = refusal(report)                                               # None when every rank fits
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from hpc_rlhf.dist.memory import DEFAULT_LORA_TARGETS, DEFAULT_OVERHEAD_GB, GB, HOST_OVERHEAD_GB, ModelShape, estimate
from hpc_rlhf.dist.placement import Plan, PlacementError, make_plan

BREAKDOWN = ("weights", "gradients", "optimizer", "activations", "kv_cache")
TRAINING_KINDS = ("actor", "critic")


class AllocationError(ValueError):
    """A job that cannot start on the allocation. `str()` is one line that starts with the key or flag to change;
    `detail` holds what helps to see why (the plan so far), or is empty."""

    def __init__(self, key: str, problem: str, detail: str = ""):
        super().__init__(f"{key}: {problem}")
        self.key, self.problem, self.detail = key, problem, detail


@dataclass(frozen=True)
class Allocation:
    """The ranks a job gets. `keys` names where each value came from (flags for `plan`, flags too for a dry run:
    the allocation is the job's, not the config's)."""
    world_size: int
    gpus_per_node: int
    gpu_memory_gb: float = 80.0
    overhead_gb: float = DEFAULT_OVERHEAD_GB
    host_memory_gb: float | None = None  # a node's memory; None: not checked
    keys: Mapping[str, str] = field(default_factory=lambda: {
        "world_size": "--world-size", "gpus_per_node": "--gpus-per-node", "gpu_memory_gb": "--gpu-memory-gb",
        "host_memory_gb": "--host-memory-gb"})


@dataclass(frozen=True)
class RoleLoad:
    """What one role puts on each of its GPUs: the inputs of hpc_rlhf.dist.memory.estimate, and the names the user
    knows them by (`keys`: zero_stage, adam_offload, micro_batch_size, micro_batch_tokens, seq_len,
    gradient_checkpointing, tokens_in_flight, rollout_tp, share, sequence_parallel (where the `<kind>_sp` keys are
    written); a missing name is left out of the advice).

    `kind` is the memory model's kind, which may differ from the role's (a reward model trained by `hpc-rlhf rm`
    sits on the `actor` ranks of its placement but is a value model). `gpu_share`: the share of the GPU this role
    may take (vLLM's gpu_memory_utilization), None for the whole GPU."""
    kind: str
    shape: ModelShape
    zero_stage: int = 0
    adam_offload: bool = False
    micro_batch_size: int = 1
    micro_batch_tokens: int = 0  # > 0: passes cut by this token budget instead of micro_batch_size samples
    seq_len: int = 2048
    gradient_checkpointing: bool = True
    tokens_in_flight: int = 0
    dtype_bytes: int = 2
    weight_sync_bucket_mb: float = 0.0
    gpu_share: float | None = None
    lora_rank: int = 0  # > 0: the role trains (actor) or serves (rollout) a LoRA adapter of this rank
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    sleeps_on_host: bool = False  # a rollout engine that keeps its weights in host memory while the actor trains
    keys: Mapping[str, str] = field(default_factory=dict)


def plan_on(placement, allocation: Allocation, placement_key: str) -> Plan:
    """The plan of `placement` on the allocation; a placement that does not fit it as an AllocationError."""
    try:
        return make_plan(placement, allocation.world_size, allocation.gpus_per_node)
    except PlacementError as exc:
        first, _, rest = str(exc).partition("\n")
        raise AllocationError(placement_key, first, rest) from None


def check_allocation(placement, allocation: Allocation, load_of: Callable[[str, str], RoleLoad],
                     placement_key: str = "--placement",
                     extra_gb_of: Callable[[Plan], Mapping[str, float]] | None = None) -> dict:
    """The plan of `placement` on the allocation and each role's memory per GPU, as the JSON-ready dictionary that
    `hpc-rlhf plan --json` prints (`fits` per role and overall). `load_of(role name, role kind)` gives a role's
    load; `extra_gb_of(plan)`, GB more on each rank of a role, by role name (the NCCL communicators' buffers a
    rank holds: hpc_rlhf.scale.communicators, which knows the RL job's routes), counted in the breakdown as
    `nccl`. Raises AllocationError when the placement cannot be laid out on the allocation or a role's settings
    make no sense to the memory model (Adam offload without ZeRO, ...)."""
    for name, value in (("world_size", allocation.world_size), ("gpus_per_node", allocation.gpus_per_node)):
        if value < 1:
            raise AllocationError(allocation.keys[name], f"must be at least 1, got {value}")
    if allocation.gpu_memory_gb <= 0:
        raise AllocationError(allocation.keys["gpu_memory_gb"], f"must be positive, got {allocation.gpu_memory_gb}")
    if allocation.host_memory_gb is not None and allocation.host_memory_gb <= 0:
        raise AllocationError(allocation.keys.get("host_memory_gb", "--host-memory-gb"),
                              f"must be positive (a node's memory in GB), got {allocation.host_memory_gb:g}")
    plan = plan_on(placement, allocation, placement_key)
    own: dict[str, dict[str, float]] = {}
    loads: dict[str, RoleLoad] = {}
    for name, role in plan.roles.items():
        load = loads[name] = load_of(name, role.kind)
        tp = len(role.engines[0]) if role.engines else 1
        k = plan.sequence_parallel(name)
        if load.shape.heads % k:  # the block splits the attention heads (a dry run names the model's folder first)
            raise AllocationError(placement_key, f"{role.kind}_sp={k} does not divide the {load.shape.heads} "
                                                 f"attention heads of {name}'s model {load.shape.name}: the {k} ranks "
                                                 f"sharing a row split its heads")
        try:
            own[name] = estimate(load.kind, load.shape, role.size, load.zero_stage,
                                 load.adam_offload and load.kind in TRAINING_KINDS, tp=tp,
                                 micro_batch_size=load.micro_batch_size, seq_len=load.seq_len,
                                 micro_batch_tokens=load.micro_batch_tokens,
                                 gradient_checkpointing=load.gradient_checkpointing,
                                 tokens_in_flight=load.tokens_in_flight, overhead_gb=0.0,
                                 dtype_bytes=load.dtype_bytes, weight_sync_bucket_mb=load.weight_sync_bucket_mb,
                                 lora_rank=load.lora_rank, lora_targets=load.lora_targets,
                                 sleeps_on_host=load.sleeps_on_host,
                                 sequence_parallel=plan.sequence_parallel(name))
        except ValueError as exc:  # settings the memory model refuses: name the setting that is wrong
            key = load.keys.get("adam_offload" if "offload" in str(exc) else "zero_stage", name)
            raise AllocationError(key, f"role '{name}': {exc}") from None
    extra = dict(extra_gb_of(plan)) if extra_gb_of is not None else {}
    roles = {}
    for name, role in plan.roles.items():
        # Colocated roles share every rank (placement never overlaps roles partially), so a rank of this role
        # holds every role with the same rank set.
        sharing = [other for other, p in plan.roles.items() if p.ranks == role.ranks]
        per_rank = sum(own[other]["total"] for other in sharing) + allocation.overhead_gb + extra.get(name, 0.0)
        share = loads[name].gpu_share
        limit = allocation.gpu_memory_gb * share if share is not None else allocation.gpu_memory_gb
        roles[name] = {
            "kind": role.kind, "memory_kind": loads[name].kind, "model": loads[name].shape.name,
            "ranks": list(role.ranks), "nodes": list(role.nodes),
            "colocated_with": role.colocated_with, "engines": [list(e) for e in role.engines],
            "groups": _groups_text(plan, name),
            "memory_gb_per_rank": round(per_rank, 3),
            "own_memory_gb": round(own[name]["total"], 3),
            # the whole model as a Hugging Face folder writes it (final/, best/, a checkpoint's hf/)
            "model_gb": round(loads[name].shape.num_params * loads[name].dtype_bytes / GB, 6),
            "limit_gb": round(limit, 3),
            "breakdown_gb": {k: round(own[name][k], 3) for k in BREAKDOWN}
            | {"cpu_optimizer": round(own[name]["cpu_optimizer"], 3)}
            | ({"nccl": round(extra[name], 3)} if name in extra else {}),
            # A role capped at a share of the GPU (a vLLM engine) must fit its own model in that share; the GPU
            # as a whole must hold every role on the rank.
            "sequence_parallel": plan.sequence_parallel(name),
            "fits": per_rank <= allocation.gpu_memory_gb and (share is None or own[name]["total"] <= limit),
        }
    host = _host_per_node(plan, own, allocation)
    actor_shape = loads["actor"].shape
    return {
        "world_size": plan.world_size, "ranks_per_node": plan.ranks_per_node, "nodes": plan.num_nodes,
        "model": {"name": actor_shape.name, "params": actor_shape.num_params},
        "zero_stage": loads["actor"].zero_stage, "adam_offload": loads["actor"].adam_offload,
        "gpu_memory_gb": allocation.gpu_memory_gb, "overhead_gb": allocation.overhead_gb, "roles": roles,
        "host": host,
        "fits": all(r["fits"] for r in roles.values()) and host["fits"],
        "_advice": {name: _advice(name, loads[name], roles[name], allocation,
                                  _sequence_fix(plan, name, loads[name], roles[name], own[name], allocation))
                    for name in roles}
        | ({} if host["fits"] else {"_host": _host_advice(host, loads, allocation, placement_key)}),
    }


def _host_per_node(plan: Plan, own: Mapping[str, Mapping[str, float]], allocation: Allocation) -> dict:
    """Host memory of every node: each of its ranks' roles' `host` (offloaded optimizer states, a sleeping
    engine's weights) plus HOST_OVERHEAD_GB per rank, against `allocation.host_memory_gb` when given."""
    per_node = [0.0] * plan.num_nodes
    for rank in range(plan.world_size):
        per_node[rank // plan.ranks_per_node] += HOST_OVERHEAD_GB
    by_role = [dict.fromkeys(plan.roles, 0.0) for _ in range(plan.num_nodes)]
    for name, role in plan.roles.items():
        for rank in role.ranks:
            node = rank // plan.ranks_per_node
            per_node[node] += own[name]["host"]
            by_role[node][name] += own[name]["host"]
    limit = allocation.host_memory_gb
    return {"gb_per_node": [round(gb, 1) for gb in per_node],
            "by_role": [{k: round(v, 1) for k, v in roles.items() if v} for roles in by_role],
            "limit_gb": limit, "fits": limit is None or max(per_node) <= limit}


def _host_advice(host: dict, loads: Mapping[str, RoleLoad], allocation: Allocation, placement_key: str) -> str:
    """The line a node short of host memory is refused with: the offload setting of the role that puts most there,
    else the placement."""
    node = max(range(len(host["gb_per_node"])), key=lambda n: host["gb_per_node"][n])
    need, by_role = host["gb_per_node"][node], host["by_role"][node]
    heaviest = max(by_role, key=by_role.get) if by_role else None
    memory_key = allocation.keys.get("host_memory_gb", "--host-memory-gb")
    what = f"node {node} needs {need:.0f} GB of host memory, more than {host['limit_gb']:g} GB ({memory_key})"
    offload_key = loads[heaviest].keys.get("adam_offload") if heaviest and loads[heaviest].adam_offload else None
    if offload_key:
        return (f"{offload_key}: {what}: the Adam states role '{heaviest}' offloads take {by_role[heaviest]:.0f} GB "
                f"there; try nodes with more memory ({memory_key}), fewer ranks of '{heaviest}' per node "
                f"({placement_key}), or {_setting(offload_key, False)} on GPUs that hold the optimizer")
    return (f"{placement_key}: {what}" + (f": role '{heaviest}' puts {by_role[heaviest]:.0f} GB there"
                                          if heaviest else "") + f"; try fewer ranks per node or {memory_key}")


def _sequence_fix(plan: Plan, name: str, load: RoleLoad, row: dict, own: Mapping[str, float],
                  allocation: Allocation) -> int | None:
    """For a role that does not fit: the smallest larger `<kind>_sp` that the placement and the model's heads allow
    and with which it would fit (only its activations change); None when there is none or the role fits."""
    role = plan.role(name)
    k = plan.sequence_parallel(name)
    if row["fits"] or role.kind == "rollout" or "sequence_parallel" not in load.keys:
        return None
    node = min(plan.world_size, plan.ranks_per_node)
    shape = load.shape
    for larger in range(k + 1, role.size + 1):
        if role.size % larger or shape.heads % larger \
                or (larger > node and larger % node):  # what placement and the heads check would refuse
            continue
        smaller = estimate(load.kind, shape, role.size, load.zero_stage,
                           load.adam_offload and load.kind in TRAINING_KINDS, micro_batch_size=load.micro_batch_size,
                           seq_len=load.seq_len, micro_batch_tokens=load.micro_batch_tokens,
                           gradient_checkpointing=load.gradient_checkpointing,
                           overhead_gb=0.0, dtype_bytes=load.dtype_bytes,
                           weight_sync_bucket_mb=load.weight_sync_bucket_mb, lora_rank=load.lora_rank,
                           lora_targets=load.lora_targets, sequence_parallel=larger)
        if row["memory_gb_per_rank"] - own["total"] + smaller["total"] <= allocation.gpu_memory_gb:
            return larger
    return None


def _groups_text(plan: Plan, name: str) -> list[str]:
    """The role and weight-sync groups a role takes part in (those hpc_rlhf.dist.groups creates; a rollout role
    has none of its own, its engines are listed, and the experience routes are left out)."""
    role = plan.role(name)
    groups = [f"{len(role.engines)} engine(s) of {len(role.engines[0])}"] if role.kind == "rollout" \
        else [f"role({role.size})"]
    if plan.sequence_parallel(name) > 1:
        groups.append(f"{role.size // role.sp} x sequence({role.sp})")
    if plan.has("rollout") and (role.kind == "rollout" or name == "actor"):
        sync_size = len(set(plan.role("rollout").ranks) | {plan.role("actor").leader})
        groups.append(f"weight-sync({sync_size})" + (" leader" if name == "actor" else ""))
    return groups


def _setting(key: str, value) -> str:
    """How the user writes `key` set to `value`: a flag (`--zero-stage 3`, `--adam-offload`, or for a switch that
    is off, "no --adam-offload") or a key (`x=3`)."""
    if not key.startswith("--"):
        return f"{key}={str(value).lower() if isinstance(value, bool) else value}"
    if isinstance(value, bool):
        return key if value else f"no {key}"
    return f"{key} {value}"


def _advice(name: str, load: RoleLoad, row: dict, allocation: Allocation, sequence_fix: int | None = None) -> str:
    """The one line a role that does not fit is refused with: the setting to change first, then the others.
    `sequence_fix`: a `<kind>_sp` with which the role would fit (`_sequence_fix`)."""
    keys = load.keys
    over_share = load.gpu_share is not None and row["own_memory_gb"] > row["limit_gb"]
    levers: list[tuple[str, str]] = []  # (the key, what to do with it)
    sequence = _sequence_lever(load, row, allocation, sequence_fix)
    breakdown = row["breakdown_gb"]
    if sequence and breakdown["activations"] == max(breakdown[k] for k in BREAKDOWN):
        levers.append(sequence)  # activations are what does not fit: only splitting the row shrinks them
    if over_share and "share" in keys:
        levers.append((keys["share"], f"a larger {keys['share']} (now {load.gpu_share:g}: {row['limit_gb']:.1f} GB)"))
    if load.kind in TRAINING_KINDS and not load.adam_offload and "adam_offload" in keys:
        levers.append((keys["adam_offload"], f"{_setting(keys['adam_offload'], True)} (moves "
                                             f"{row['breakdown_gb']['optimizer']:.1f} GB of Adam states per GPU to "
                                             f"host memory)"))
    if load.kind != "rollout" and load.zero_stage < 3 and "zero_stage" in keys:
        levers.append((keys["zero_stage"], f"{_setting(keys['zero_stage'], 3)} (shards the weights over the role's "
                                           f"ranks)"))
    if load.kind in TRAINING_KINDS and not load.gradient_checkpointing and "gradient_checkpointing" in keys:
        levers.append((keys["gradient_checkpointing"], _setting(keys["gradient_checkpointing"], True)))
    if load.kind == "rollout" and "rollout_tp" in keys:
        levers.append((keys["rollout_tp"], f"a larger rollout_tp in {keys['rollout_tp']}"))
    if load.kind == "rollout" and "tokens_in_flight" in keys:
        levers.append((keys["tokens_in_flight"], f"fewer sequences per engine ({keys['tokens_in_flight']})"))
    if load.kind != "rollout" and load.micro_batch_tokens:  # the budget cuts the passes, not the sample count
        if load.micro_batch_tokens > load.seq_len and "micro_batch_tokens" in keys:
            levers.append((keys["micro_batch_tokens"], f"a smaller {keys['micro_batch_tokens']} (down to one "
                                                       f"sample's {load.seq_len} tokens)"))
    elif load.kind != "rollout" and load.micro_batch_size > 1 and "micro_batch_size" in keys:
        levers.append((keys["micro_batch_size"], f"a smaller {keys['micro_batch_size']}"))
    if sequence and sequence not in levers:
        levers.append(sequence)
    gpu_key = allocation.keys["gpu_memory_gb"]
    levers.append((gpu_key, f"GPUs with more memory ({gpu_key})"))
    need, limit = (row["own_memory_gb"], row["limit_gb"]) if over_share else \
        (row["memory_gb_per_rank"], allocation.gpu_memory_gb)
    (head, first), others = levers[0], [text for _, text in levers[1:]]
    return (f"{head}: role '{name}' needs {need:.1f} GB per GPU, more than {limit:g} GB; try {first}"
            + (f"; or {'; or '.join(others)}" if others else ""))


def _sequence_lever(load: RoleLoad, row: dict, allocation: Allocation, fix: int | None) -> tuple[str, str] | None:
    """(key, advice) to split the role's rows over more ranks when its activations exceed what it is over the GPU
    by; None otherwise."""
    if load.kind == "rollout" or "sequence_parallel" not in load.keys:
        return None
    activations, over = row["breakdown_gb"]["activations"], row["memory_gb_per_rank"] - allocation.gpu_memory_gb
    if over <= 0 or activations <= over:
        return None
    sp_key, k = f"{row['kind']}_sp", row["sequence_parallel"]
    where = load.keys["sequence_parallel"]
    now = f"activations take {activations:.1f} GB per GPU at {sp_key}={k}"
    if fix is not None:
        return where, f"{sp_key}={fix} in {where} ({now}; {fix} ranks share each packed row)"
    return where, f"a larger {sp_key} in {where} ({now}; K ranks sharing a packed row hold 1/K of them)"


def refusal(report: dict) -> str | None:
    """None when every rank fits; else one line naming the setting to change for the first role that does not."""
    for name, row in report["roles"].items():
        if not row["fits"]:
            return report["_advice"][name]
    return host_refusal(report)


def host_refusal(report: dict) -> str | None:
    """None when every node's host memory fits (or none was given); else the one line naming the setting to change.
    `hpc-rlhf simulate` refuses on this alone: it reports each rank's GPU memory instead, since the layouts it is
    for (its 1,024-rank example's rollout engines, ZeRO-0 at scale) are over the GPU's and still worth simulating."""
    return None if report["host"]["fits"] else report["_advice"]["_host"]


def public(report: dict) -> dict:
    """The report without its private advice (what `--json` prints)."""
    return {k: v for k, v in report.items() if not k.startswith("_")}
