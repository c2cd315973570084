"""Role placement: which global ranks hold which model role. Pure Python: no torch, no communication.

Every rank computes the same plan from (placement spec, world size, ranks per node), so ranks agree on the
layout without exchanging a message, and a bad layout fails before any process group exists.

Placement spec
--------------
As a string, entries separated by commas or spaces::

    actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2

- `NAME=N` gives role NAME its own N ranks. Roles: `actor`, `critic`, `ref`, `teacher` (on-policy distillation),
  `reward`, `rollout`.
- Several reward models are named `reward`, `reward2`, `reward3`, ... (in that order; `reward2` needs
  `reward`). Each is a role of kind `reward`.
- `A+B=N` colocates: the same N ranks hold both A and B (e.g. `actor+ref=4`, `critic+reward=2`). Each role
  still gets its own process group.
- `rollout@actor` is the hybrid engine: generation runs on the actor's ranks (no count of its own).
- `rollout_tp=K` makes rollout engines of K ranks (tensor parallel); default 1.
- `actor_sp=K`, `critic_sp=K`, `ref_sp=K`, `teacher_sp=K`, `reward_sp=K` (every reward model: reward, reward2, ...)
  make K ranks of that role share one packed row (sequence parallel; default 1). The role's ranks, in their
  order, are cut into blocks of K consecutive ranks (`Plan.sequence_blocks`); K must divide the role's count.
  The rollout has no such key: its engines split a sequence with rollout_tp.

As YAML, a mapping of the same entries, where `reward` may take a list with one count per reward model::

    placement: {actor: 4, critic: 2, ref: 1, reward: [1, 1], rollout: 8, rollout_tp: 2}
    placement: {actor+ref: 4, rollout@actor: null, rollout_tp: 2}

or a list of entries (strings or one-key mappings): `["actor=4", "rollout@actor", {rollout_tp: 2}]`.

Rules: an actor is always required (`actor=N` alone is the single-model layout); counts add up to the world
exactly; every rollout engine (K ranks) sits inside one node; no role is given twice. A sequence block sits inside
one node when K is at most a node's ranks (its all-to-all runs every layer, so it must not cross the slower
network), and is whole nodes when K is larger.

Packing
-------
Ranks are assigned deterministically. First the number of ranks of each role on each node is chosen, so that
each role touches as few nodes as possible: rollout engines first (they are the only units that cannot be cut
anywhere), then the other units (a colocated group is one unit) from largest to smallest, each into the node
with the least room that still holds it whole, or, when none does, spread over the emptiest nodes. Then nodes
are numbered so that the node holding the actor comes first, and inside a node roles take consecutive ranks
in the order actor, critic, ref, teacher, reward, reward2, ..., rollout. So the 16-rank layout above on 8-rank nodes
puts actor on 0-3, critic 4-5, ref 6, reward 7 and the rollout engines on 8-15.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from math import lcm
from typing import Any, Iterable, Mapping

ROLE_KINDS = ("actor", "critic", "ref", "teacher", "reward", "rollout")
# `<kind>_sp` keys: the role kinds whose models run forward/backward on packed rows (not the rollout engines).
SEQUENCE_PARALLEL_KEYS = {f"{kind}_sp": kind for kind in ("actor", "critic", "ref", "teacher", "reward")}
_REWARD_NAME = re.compile(r"reward(?:([2-9]|[1-9][0-9]+))?")


class PlacementError(ValueError):
    """An invalid placement; the message names the problem and shows the plan so far."""


@dataclass(frozen=True)
class RoleSpec:
    """One role as the user asked for it, before ranks are assigned."""
    name: str
    kind: str
    count: int | None  # None for a hybrid rollout, which takes its host's ranks
    colocated: tuple[str, ...] = ()  # the other roles of its `A+B=N` entry
    hybrid_on: str | None = None  # `rollout@actor` -> "actor"
    tp: int = 1  # ranks per rollout engine
    sp: int = 1  # ranks sharing one packed row (`<kind>_sp`)


@dataclass(frozen=True)
class RolePlacement:
    name: str
    kind: str
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    colocated_with: str | None  # the first other role (plan order) holding exactly the same ranks
    engines: tuple[tuple[int, ...], ...] = ()  # rollout only: the ranks of each engine
    sp: int = 1  # ranks sharing one packed row (`<kind>_sp`)

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Plan:
    world_size: int
    ranks_per_node: int
    roles: dict[str, RolePlacement] = field(default_factory=dict)

    def role(self, name: str) -> RolePlacement:
        try:
            return self.roles[name]
        except KeyError:
            raise PlacementError(f"this plan has no role '{name}'; its roles are {', '.join(self.roles)}") from None

    def has(self, name: str) -> bool:
        return name in self.roles

    def roles_of_rank(self, rank: int) -> list[str]:
        if not 0 <= rank < self.world_size:
            raise PlacementError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return [name for name, role in self.roles.items() if rank in role.ranks]

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // self.ranks_per_node))

    @property
    def rollout_tp(self) -> int:
        rollout = self.roles.get("rollout")
        return len(rollout.engines[0]) if rollout and rollout.engines else 1

    def sequence_parallel(self, role: str) -> int:
        """How many ranks of `role` share one packed row: its `<kind>_sp` (reward2 takes reward_sp); 1 if not
        given."""
        return self.role(role).sp

    def sequence_blocks(self, role: str) -> list[tuple[int, ...]]:
        """The ranks of `role`, in role order, cut into blocks of `sequence_parallel(role)` consecutive ranks;
        each block shares one sequence. One rank per block when the role is not sequence parallel."""
        placement = self.role(role)
        k = placement.sp
        return [placement.ranks[i:i + k] for i in range(0, placement.size, k)]

    @property
    def is_hybrid(self) -> bool:
        """True when generation runs on the actor's ranks (`rollout@actor`)."""
        rollout = self.roles.get("rollout")
        return rollout is not None and rollout.ranks == self.role("actor").ranks

    def format_table(self) -> str:
        rows = [(p.name, format_ranks(p.ranks), format_ranks(p.nodes), p.colocated_with or "-", _engines_text(p),
                 _sequence_text(p)) for p in self.roles.values()]
        title = f"{self.world_size} ranks on {self.num_nodes} node(s) of {self.ranks_per_node}"
        return title + "\n" + format_rows(("role", "ranks", "nodes", "shares ranks with", "engines", "sequence"),
                                          rows)

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "roles": {name: {"kind": p.kind, "ranks": list(p.ranks), "nodes": list(p.nodes),
                                 "colocated_with": p.colocated_with, "engines": [list(e) for e in p.engines],
                                 "sequence_parallel": p.sp}
                          for name, p in self.roles.items()}}


# ------------------------------------------------------------------------------------------------ formatting
def format_ranks(ranks: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8, 10, 11) -> '0-3,8,10-11'."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts) or "-"


def format_rows(header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _sequence_text(p: RolePlacement) -> str:
    if p.sp == 1:
        return "-"
    return f"sp={p.sp}: {p.size // p.sp} block(s) of {p.sp}"


def _engines_text(p: RolePlacement) -> str:
    if not p.engines:
        return "-"
    return f"{len(p.engines)} x tp{len(p.engines[0])}: " + " ".join(format_ranks(e) for e in p.engines)


# ---------------------------------------------------------------------------------------------------- parsing
def role_kind(name: str) -> str:
    """The kind of a role name: 'reward3' -> 'reward'. Unknown names raise PlacementError."""
    if name in ("actor", "critic", "ref", "teacher", "rollout"):
        return name
    if _REWARD_NAME.fullmatch(name):
        return "reward"
    hint = ""
    if re.fullmatch(r"reward_?[0-9]+", name):
        hint = "; the first reward model is 'reward', further ones 'reward2', 'reward3', ..."
    else:
        near = difflib.get_close_matches(name, list(ROLE_KINDS), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
    raise PlacementError(f"unknown role '{name}'{hint} (roles: actor, critic, ref, teacher, reward, reward2, ..., "
                         f"rollout)")


def _role_order(name: str) -> tuple[int, int]:
    """Canonical order: actor, critic, ref, teacher, reward, reward2, ..., rollout."""
    kind = role_kind(name)
    index = 0
    if kind == "reward":
        suffix = _REWARD_NAME.fullmatch(name).group(1)
        index = int(suffix) if suffix else 1
    return ROLE_KINDS.index(kind), index


def _entries(spec: Any) -> list[tuple[str, Any]]:
    """Any accepted spec form -> a flat list of (key, value) entries; value None for `rollout@actor`."""
    if isinstance(spec, str):
        entries = []
        for token in re.split(r"[,\s]+", spec.strip()):
            if not token:
                continue
            key, sep, value = token.partition("=")
            if sep and not value:
                raise PlacementError(f"placement entry '{token}' has no count after '='")
            entries.append((key.strip(), value.strip() if sep else None))
        return entries
    if isinstance(spec, Mapping):
        entries = []
        for key, value in spec.items():
            key = str(key)
            if isinstance(value, (list, tuple)):
                if key != "reward":
                    raise PlacementError(f"placement entry '{key}' has a list of counts {list(value)}; only "
                                         f"'reward' takes a list (one count per reward model)")
                if not value:
                    raise PlacementError("placement entry 'reward' has an empty list of counts")
                entries.extend((_reward_name(i), count) for i, count in enumerate(value))
            else:
                entries.append((key, value))
        return entries
    if isinstance(spec, (list, tuple)):
        entries = []
        for item in spec:
            if isinstance(item, (str, Mapping)):
                entries.extend(_entries(item))
            else:
                raise PlacementError(f"placement list item {item!r} is neither an entry like 'actor=4' nor a "
                                     f"mapping like {{actor: 4}}")
        return entries
    raise PlacementError(f"a placement is a string like 'actor=4,rollout=4', a mapping or a list, "
                         f"not {type(spec).__name__}")


def _reward_name(index: int) -> str:
    return "reward" if index == 0 else f"reward{index + 1}"


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise PlacementError(f"placement entry '{key}' needs a count, like '{key}=2'")
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and re.fullmatch(r"[0-9]+", value):
        count = int(value)
    else:
        raise PlacementError(f"placement entry '{key}={value}': the count must be a whole number")
    if count < 1:
        raise PlacementError(f"placement entry '{key}={value}': the count must be at least 1")
    return count


def parse_spec(spec: str | Mapping | list | tuple) -> list[RoleSpec]:
    """Read a placement spec (see the module docstring) into one RoleSpec per role, in the order given."""
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, RoleSpec) for s in spec):
        return list(spec)
    roles: dict[str, RoleSpec] = {}
    tp: int | None = None
    sp: dict[str, int] = {}  # `<kind>_sp` key -> K

    def add(role: RoleSpec, entry: str) -> None:
        if role.name in roles:
            hint = "; name further reward models reward2, reward3, ..." if role.kind == "reward" else ""
            raise PlacementError(f"role '{role.name}' is given twice (again in '{entry}'){hint}")
        roles[role.name] = role

    for key, value in _entries(spec):
        entry = key if value is None else f"{key}={value}"
        if key == "rollout_tp":
            if tp is not None:
                raise PlacementError("'rollout_tp' is given twice")
            tp = _count(key, value)
        elif key in SEQUENCE_PARALLEL_KEYS:
            if key in sp:
                raise PlacementError(f"'{key}' is given twice")
            sp[key] = _count(key, value)
        elif key == "rollout_sp":
            raise PlacementError("'rollout_sp': rollout engines split a sequence by tensor parallelism; use "
                                 "rollout_tp")
        elif "@" in key:
            guest, _, host = key.partition("@")
            if guest != "rollout":
                raise PlacementError(f"'{key}': only the rollout can run on another role's ranks "
                                     f"('rollout@actor')")
            if host != "actor":
                raise PlacementError(f"'{key}': a hybrid rollout runs on the actor's ranks; write 'rollout@actor'")
            if value is not None and value is not True:
                raise PlacementError(f"'{entry}': a hybrid rollout takes no count, it uses the actor's ranks")
            add(RoleSpec("rollout", "rollout", None, hybrid_on="actor"), entry)
        else:
            names = key.split("+")
            for name in names:
                if not name:
                    raise PlacementError(f"placement entry '{entry}' has an empty role name")
                if name == "rollout" and len(names) > 1:
                    raise PlacementError(f"'{entry}': to generate on another role's ranks write 'rollout@actor'")
                role_kind(name)
            if len(set(names)) < len(names):
                raise PlacementError(f"'{entry}' names a role twice")
            count = _count(key, value)
            for name in names:
                add(RoleSpec(name, role_kind(name), count, colocated=tuple(n for n in names if n != name)),
                    entry)

    if not roles:
        raise PlacementError("the placement is empty; give at least 'actor=N'")
    if "actor" not in roles:
        raise PlacementError(f"the placement has no actor (roles given: {', '.join(roles)}); every layout "
                             f"needs 'actor=N'")
    for name, role in roles.items():
        if role.kind == "reward" and name != "reward":
            previous = _reward_name(_role_order(name)[1] - 2)
            if previous not in roles:
                raise PlacementError(f"'{name}' is given without '{previous}'; reward models are named reward, "
                                     f"reward2, reward3, ... in order")
    if tp is not None:
        if "rollout" not in roles:
            raise PlacementError(f"'rollout_tp={tp}' is given but there is no rollout role")
        rollout = roles["rollout"]
        roles["rollout"] = RoleSpec(rollout.name, rollout.kind, rollout.count, rollout.colocated,
                                    rollout.hybrid_on, tp)
    for key, k in sp.items():
        kind = SEQUENCE_PARALLEL_KEYS[key]
        targets = [role for role in roles.values() if role.kind == kind]
        if not targets:
            raise PlacementError(f"'{key}={k}' is given but the placement has no {kind} role")
        for role in targets:
            if role.count % k:
                raise PlacementError(f"{key}={k} does not divide the {role.name}'s {role.count} ranks; a role's "
                                     f"ranks are cut into sequence blocks of {key} ranks")
            roles[role.name] = replace(role, sp=k)
    rollout = roles.get("rollout")
    if rollout is not None:
        host_count = roles["actor"].count if rollout.hybrid_on else rollout.count
        if host_count % rollout.tp:
            what = f"the actor's {host_count} ranks (rollout@actor)" if rollout.hybrid_on else \
                f"rollout={host_count}"
            raise PlacementError(f"{what} cannot be cut into engines of rollout_tp={rollout.tp} ranks; the "
                                 f"count must be a multiple of rollout_tp")
    return list(roles.values())


# ---------------------------------------------------------------------------------------------------- packing
@dataclass
class _Unit:
    """Ranks placed together: one role, or a colocated group of roles."""
    names: tuple[str, ...]
    size: int
    atom: int  # a node takes a multiple of this many of the unit's ranks (rollout engines, sequence blocks)
    spec_index: int
    atom_keys: tuple[str, ...] = ()  # the entries the atom comes from, for messages: ('rollout_tp=2', 'actor_sp=4')

    @property
    def order(self) -> tuple:
        return min(_role_order(n) for n in self.names), self.spec_index


def _units(roles: list[RoleSpec]) -> list[_Unit]:
    by_name = {r.name: r for r in roles}
    hybrid_tp = next((r.tp for r in roles if r.hybrid_on), 1)
    units, seen = [], set()
    for index, role in enumerate(roles):
        if role.hybrid_on or role.name in seen:
            continue
        names = (role.name,) + role.colocated
        seen.update(names)
        atom = role.tp if role.kind == "rollout" else 1
        if "actor" in names:  # engines of a hybrid rollout are cut from the actor's ranks
            atom = hybrid_tp
        keys = [f"rollout_tp={atom}"] if atom > 1 else []
        for name in names:  # a sequence block runs an all-to-all every layer: keep it off the inter-node network
            k = by_name[name].sp
            if k > 1:
                keys.append(f"{by_name[name].kind}_sp={k}")
                atom = lcm(atom, k)
        units.append(_Unit(names, by_name[role.name].count, atom, index, tuple(keys)))
    return units


def _pack(unit: _Unit, free: list[int]) -> list[tuple[int, int]] | None:
    """(node, ranks) pieces for `unit`, taken from `free` (updated); None when engines cannot fit."""
    def room(node: int) -> int:
        return free[node] // unit.atom * unit.atom

    pieces, remaining = [], unit.size
    while remaining:
        whole = [n for n in range(len(free)) if room(n) >= remaining]
        if whole:  # the tightest node that holds the rest in one piece
            node = min(whole, key=lambda n: (room(n), n))
            take = remaining
        else:  # the rest spans nodes: take the emptiest node completely
            node = max(range(len(free)), key=lambda n: (room(n), -n))
            take = room(node)
            if take == 0:
                return None
        pieces.append((node, take))
        free[node] -= take
        remaining -= take
    return pieces


def _assign(units: list[_Unit], packed: dict[int, list[tuple[int, int]]], ranks_per_node: int) -> dict[str, list]:
    """Node pieces -> global ranks, numbering nodes and ranks inside nodes in the canonical role order."""
    contents: dict[int, list[tuple[_Unit, int]]] = {}
    for unit_index, pieces in packed.items():
        for node, count in pieces:
            contents.setdefault(node, []).append((units[unit_index], count))
    for node in contents:
        contents[node].sort(key=lambda item: item[0].order)
    node_order = sorted(contents, key=lambda n: ([u.order for u, _ in contents[n]], n))
    ranks: dict[str, list[int]] = {}
    for new_index, node in enumerate(node_order):
        next_rank = new_index * ranks_per_node
        for unit, count in contents[node]:
            for name in unit.names:
                ranks.setdefault(name, []).extend(range(next_rank, next_rank + count))
            next_rank += count
    return ranks


def _error(problem: str, roles: list[RoleSpec], ranks: dict[str, list[int]], ranks_per_node: int) -> PlacementError:
    rows = []
    for role in roles:
        count = "(actor's)" if role.hybrid_on else role.count
        placed = ranks.get(role.hybrid_on or role.name)
        nodes = sorted({r // ranks_per_node for r in placed}) if placed else []
        rows.append((role.name, count, format_ranks(placed) if placed else "(not placed)", format_ranks(nodes)))
    table = format_rows(("role", "count", "ranks", "nodes"), rows)
    return PlacementError(f"{problem}\nplan so far:\n{table}")


def make_plan(spec: str | Mapping | list, world_size: int, ranks_per_node: int) -> Plan:
    """The placement of every role on `world_size` ranks, `ranks_per_node` to a node. The world must fill whole
    nodes, except that a world smaller than one node is that one node."""
    roles = parse_spec(spec)
    if world_size < 1 or ranks_per_node < 1:
        raise _error(f"world size ({world_size}) and ranks per node ({ranks_per_node}) must be at least 1",
                     roles, {}, max(ranks_per_node, 1))
    if world_size > ranks_per_node and world_size % ranks_per_node:
        raise _error(f"world size {world_size} is not a whole number of nodes of {ranks_per_node} ranks",
                     roles, {}, ranks_per_node)
    node_size = min(world_size, ranks_per_node)
    rollout = next((r for r in roles if r.kind == "rollout"), None)
    if rollout is not None and rollout.tp > node_size:
        raise _error(f"rollout_tp={rollout.tp} is larger than a node ({node_size} ranks); a tensor-parallel "
                     f"engine must sit inside one node", roles, {}, ranks_per_node)
    units = _units(roles)
    total = sum(u.size for u in units)
    if total != world_size:
        counted = " + ".join(f"{'+'.join(u.names)}={u.size}" for u in units)
        raise _error(f"the placement asks for {total} ranks ({counted}) but the world has {world_size}",
                     roles, {}, ranks_per_node)

    for unit in units:
        if unit.atom > node_size:  # only sequence blocks get here: rollout_tp was checked above
            if unit.atom % node_size:
                raise _error(f"'{'+'.join(unit.names)}' needs blocks of {unit.atom} ranks ({', '.join(unit.atom_keys)}), "
                             f"more than a node ({node_size} ranks) and not a whole number of nodes; a sequence "
                             f"block sits inside one node or fills whole nodes", roles, {}, ranks_per_node)
            unit.atom = node_size  # whole nodes: the blocks then cover whole nodes

    free = [node_size] * max(1, world_size // ranks_per_node)
    # Units that can only be cut at engine boundaries go first; then the largest units, which are the
    # hardest to keep on few nodes.
    order = sorted(range(len(units)), key=lambda i: (units[i].atom == 1, -units[i].size, units[i].order))
    packed: dict[int, list[tuple[int, int]]] = {}
    for index in order:
        unit = units[index]
        pieces = _pack(unit, free)
        if pieces is None:
            if any(key.startswith("rollout_tp") for key in unit.atom_keys) and len(unit.atom_keys) == 1:
                what = "rollout engines" if "rollout" in unit.names else "hybrid rollout engines (rollout@actor)"
                what = f"{what} of rollout_tp={unit.atom} ranks"
            else:
                what = f"blocks of {unit.atom} ranks ({', '.join(unit.atom_keys)})"
            raise _error(f"'{'+'.join(unit.names)}' ({unit.size} ranks) cannot be cut into {what} without "
                         f"crossing a node boundary (free ranks per node: {free})", roles,
                         _assign(units, packed, ranks_per_node), ranks_per_node)
        packed[index] = pieces
    ranks = _assign(units, packed, ranks_per_node)

    if rollout is not None and rollout.hybrid_on:
        ranks["rollout"] = list(ranks[rollout.hybrid_on])
    ordered = sorted((r.name for r in roles), key=_role_order)
    by_name = {r.name: r for r in roles}
    placements: dict[str, RolePlacement] = {}
    for name in ordered:
        role_ranks = tuple(ranks[name])
        engines: tuple[tuple[int, ...], ...] = ()
        if name == "rollout":
            engines = tuple(role_ranks[i:i + rollout.tp] for i in range(0, len(role_ranks), rollout.tp))
            for engine in engines:  # guaranteed by packing; checked because a split engine would hang NCCL
                if len({r // ranks_per_node for r in engine}) > 1:
                    raise _error(f"rollout engine on ranks {format_ranks(engine)} crosses a node boundary",
                                 roles, ranks, ranks_per_node)
        k = by_name[name].sp
        for start in range(0, len(role_ranks), k):  # guaranteed by packing, like the engines above
            block = role_ranks[start:start + k]
            if len({r // ranks_per_node for r in block}) > max(1, k // node_size):
                raise _error(f"{by_name[name].kind}_sp={k}: the sequence block on ranks {format_ranks(block)} of "
                             f"{name} crosses a node boundary", roles, ranks, ranks_per_node)
        shares = next((other for other in ordered if other != name and tuple(ranks[other]) == role_ranks), None)
        placements[name] = RolePlacement(name=name, kind=role_kind(name), ranks=role_ranks,
                                         nodes=tuple(sorted({r // ranks_per_node for r in role_ranks})),
                                         colocated_with=shares, engines=engines, sp=k)
    return Plan(world_size=world_size, ranks_per_node=ranks_per_node, roles=placements)


def world_size_of(spec: str | Mapping | list) -> int:
    """How many ranks a placement asks for (colocated and hybrid roles count once)."""
    return sum(unit.size for unit in _units(parse_spec(spec)))
