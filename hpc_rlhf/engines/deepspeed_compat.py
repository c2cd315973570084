"""Keep DeepSpeed inside a role's process group (DESIGN §9), and a test guard that proves it does.

A role trains with DeepSpeed on a subgroup of the world while other roles do something else. DeepSpeed takes
its data-parallel and model-parallel groups from the `mpu` object it is given (`RoleMpu` below), but 0.19 still
issues a few collectives on the default (WORLD) group whatever the mpu says. With two roles doing different
things those pair up with unrelated calls of the other role and hang or crash. Found by reading deepspeed
0.19.8 and confirmed by running ZeRO 0-3 on two roles of a 4-rank world under `forbid_world_collectives`
(init, steps, save_checkpoint, load_checkpoint, parameter gathering); these are all of them:

  deepspeed/...                 when                        what                        kept in the role by
  runtime/zero/stage3.py        ZeRO-3 optimizer init       dist.barrier() x3           group-less -> role group
  runtime/zero/utils.py         ZeRO-3, end of the first    assert_ints_same_as_other_  our version: broadcast
    (via partitioned_param_     step (trace validation)     ranks: 2 broadcasts from    from the role leader over
    coordinator)                                            global rank 0               the role group
  runtime/engine.py             save_checkpoint             dist.barrier() x2           group-less -> role group
  runtime/engine.py             save_checkpoint             tag validation: 2 all-      tag_validation = Ignore
                                                            reduces                     (CHECKPOINT_CONFIG)

`keep_collectives_in_group(group)` applies all of this for the duration of a `with` block; the training
engine enters it around every DeepSpeed call (init, forward, backward, step, save, load, parameter gathering).
A ZeRO-3 module also runs outside the engine's calls: the RL step scores with the bare module (`engine.module`)
and the hybrid engine generates with it. Its first hook (DeepSpeed's start-of-forward hook) validates the
parameter trace with the WORLD broadcasts above, so `keep_module_in_group(module, group)` enters the same
block around every forward of the module itself, from forward hooks placed before and after DeepSpeed's own.
That is the one mechanism for forwards: every ZeRO-3 model (trained, or frozen as a reference or reward model)
gets it when its engine is built, so no caller of a forward needs a `with` block of its own.
It patches deepspeed for the block only (nothing is edited on disk): group-less deepspeed.comm barrier calls
go to the role group (all_reduce and broadcast too, as a safety net should tag validation be turned back on or
a similar call appear), and the trace check is swapped in every module that imported it. When a newer
deepspeed adds a WORLD collective, the guard tests (tests/engines) say so.

deepspeed keeps `groups.mpu` as a module global: the last engine created on a rank wins, which is right because
every engine on a rank belongs to the same role group (colocated roles share their ranks).

Also here: `RoleMpu` (the mpu object) and `singleton_group()` (this rank alone, the model-parallel group,
created by this rank alone: hpc_rlhf.dist.groups creates no per-rank groups for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

# deepspeed_config["checkpoint"]: the tag check all-reduces over WORLD; the training engine's tag is a constant,
# the same on every rank, so the check buys nothing.
CHECKPOINT_CONFIG = {"tag_validation": "Ignore"}

# deepspeed.comm collectives redirected when called without a group, with the position of their `group`
# parameter in deepspeed/comm/comm.py. Positions are needed because deepspeed's `timed_op` decorator hides
# the signature (tests/engines/test_deepspeed_compat.py checks this table against the installed source).
DS_GROUP_POSITION = {"barrier": 0, "all_reduce": 2, "broadcast": 2}


# ------------------------------------------------------------------------------------------------ group objects
def is_world(group) -> bool:
    return group is None or group is dist.GroupMember.WORLD


_SINGLETON: dict[int, Any] = {}


def singleton_group():
    """A process group holding only this rank, created once per process.

    Created with `use_local_synchronization=True`, so only this rank takes part: a role builds its engine
    whenever it likes, without every other rank of the world having to create the same groups in the same
    order at the same moment (which the all-rank `new_group` rule would demand, and which a role that builds
    its engine alone cannot satisfy).
    """
    rank = dist.get_rank()
    if rank not in _SINGLETON:
        _SINGLETON[rank] = dist.new_group(ranks=[rank], use_local_synchronization=True)
    return _SINGLETON[rank]


def forget_singleton_group() -> None:
    """Forget this process's singleton groups (their world is gone): `hpc-rlhf simulate` visits one fake world
    per rank in one process."""
    _SINGLETON.clear()


class RoleMpu:
    """The `mpu` object DeepSpeed reads its groups from: data parallel over the role, no model parallelism.

    The model-parallel group is a real singleton group, never None: DeepSpeed passes it straight to
    collectives, where None means WORLD.
    """

    def __init__(self, group=None):
        self.data_parallel_group = dist.GroupMember.WORLD if group is None else group
        self.model_parallel_group = singleton_group()

    def get_data_parallel_group(self):
        return self.data_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.data_parallel_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.data_parallel_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.data_parallel_group)

    def get_model_parallel_group(self):
        return self.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        # Read by the universal-checkpoint load (base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir,
        # which has no fallback) when a checkpoint is resharded onto another number of ranks (engines.reshard).
        return 1


# ------------------------------------------------------------------------------------------------- redirection
def _redirect_groupless(original: Callable, position: int, group) -> Callable:
    def call(*args, **kwargs):
        if len(args) > position:
            if args[position] is None:
                args = args[:position] + (group,) + args[position + 1:]
        elif kwargs.get("group") is None:
            kwargs["group"] = group
        return original(*args, **kwargs)

    return call


def _assert_ints_same_in_group(ints: list[int], group) -> None:
    """deepspeed's assert_ints_same_as_other_ranks, with the role leader in place of global rank 0."""
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    leader = dist.get_global_rank(group, 0)
    is_leader = dist.get_rank() == leader
    length = torch.tensor([len(ints)], dtype=torch.long, device=device)
    dist.broadcast(length, src=leader, group=group)
    leader_length = int(length.item())
    # Every rank takes part in both broadcasts before any raises, so a disagreeing rank cannot leave the
    # leader waiting in the second one.
    values = torch.tensor(ints if is_leader else [0] * leader_length, dtype=torch.long, device=device)
    dist.broadcast(values, src=leader, group=group)
    if leader_length != len(ints):
        raise RuntimeError(f"ZeRO-3 trace check: rank {dist.get_rank()} has {len(ints)} entries, the role leader "
                           f"(rank {leader}) has {leader_length}")
    leader_ints = values.tolist()
    if leader_ints != list(ints):
        raise RuntimeError(f"ZeRO-3 trace check: rank {dist.get_rank()} disagrees with the role leader "
                           f"(rank {leader}):\n  leader: {leader_ints}\n  this rank: {list(ints)}")


_ASSERT_INTS = "assert_ints_same_as_other_ranks"
_holders_cache: dict[str, Any] = {"modules_seen": -1, "holders": []}


def assert_ints_holders() -> list[Any]:
    """deepspeed modules holding their own reference to assert_ints_same_as_other_ranks.

    `from ... import` and `import *` copy it into several modules (zero.stage3, parameter_offload, zenflow,
    ...), so each must be patched. Scanning sys.modules costs milliseconds; it is redone only when new modules
    have been imported since the last scan.
    """
    import sys

    if _holders_cache["modules_seen"] != len(sys.modules):
        _holders_cache["holders"] = [module for name, module in list(sys.modules.items())
                                     if name.startswith("deepspeed") and hasattr(module, _ASSERT_INTS)]
        _holders_cache["modules_seen"] = len(sys.modules)
    return _holders_cache["holders"]


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def import_deepspeed():
    """deepspeed, imported where a rank first needs it (only ranks that train or shard a model: the import costs
    ~3 CPU seconds), with its logger kept at warnings: its import sets that logger to INFO."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


@contextlib.contextmanager
def keep_collectives_in_group(group) -> Iterator[None]:
    """While inside, deepspeed's WORLD-level collectives run on `group` instead (see the module docstring).

    A no-op when `group` is the world. Nested use restores what was there before, so an engine entered
    inside another engine's block on the same rank leaves it as it found it.
    """
    if is_world(group):
        yield
        return
    import deepspeed.comm as ds_comm
    import deepspeed.runtime.zero.utils  # noqa: F401  (the trace check's home; others import it from here)

    patches = [(ds_comm, name, _redirect_groupless(getattr(ds_comm, name), position, group))
               for name, position in DS_GROUP_POSITION.items()]

    def assert_ints(ints):
        _assert_ints_same_in_group(ints, group)

    patches += [(module, _ASSERT_INTS, assert_ints) for module in assert_ints_holders()]
    with _patched(patches):
        yield


def keep_module_in_group(module: torch.nn.Module, group) -> None:
    """Every forward of `module` (the top module of a ZeRO-3 model) runs inside keep_collectives_in_group(group).

    Needed where the module is called without its engine: DeepSpeed's first forward hook on it resets the
    parameter trace and, while the trace is being recorded (the first pass, and again whenever the order of
    passes changes, e.g. scoring between training steps), checks it with broadcasts from global rank 0 over
    WORLD. The pre-hook goes in front of DeepSpeed's hooks; the post-hook runs after them, also when the
    forward raises. A no-op when `group` is the world.
    """
    if is_world(group):
        return
    stack: list[contextlib.ExitStack] = []

    def enter(_module, _args):
        entered = contextlib.ExitStack()
        entered.enter_context(keep_collectives_in_group(group))
        stack.append(entered)

    def leave(_module, _args, _output):
        if stack:
            stack.pop().close()

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)


# ------------------------------------------------------------------------------------------------------ guard
# torch.distributed collectives; deepspeed's TorchBackend looks these up on the module at each call.
TORCH_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
                     "_all_gather_base", "all_gather_object", "all_gather_coalesced", "reduce", "reduce_scatter",
                     "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
                     "barrier", "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list",
                     "all_to_all", "all_to_all_single")


class WorldCollectiveError(RuntimeError):
    """A collective was issued on the WORLD group inside `forbid_world_collectives`."""


@dataclasses.dataclass
class WorldCollective:
    name: str
    stack: str


def _group_argument(signature: inspect.Signature, args, kwargs):
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None  # let the real call raise its own error
    return bound.arguments.get("group")


def _guarded(name: str, original: Callable, on_world: Callable[[str], None]) -> Callable:
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        if is_world(_group_argument(signature, args, kwargs)):
            on_world(name)
        return original(*args, **kwargs)

    return call


def _guarded_new_group(original: Callable, on_world: Callable[[str], None]) -> Callable:
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        # Without local synchronization new_group waits for every rank of the world.
        if not bound.arguments.get("use_local_synchronization", False):
            on_world("new_group")
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def forbid_world_collectives(allowed_world: bool = False) -> Iterator[list[WorldCollective]]:
    """Catch collectives on the WORLD group (group None or WORLD) issued while inside.

    Yields the list of offending calls (name and stack). With `allowed_world=False` an offending call raises
    `WorldCollectiveError` before it is issued, so a test fails at the culprit instead of hanging; with
    `allowed_world=True` the call is recorded and then issued (for finding culprits in symmetric runs).
    Covers torch.distributed's collectives, the all-gather/reduce-scatter functions deepspeed's backend
    captured at start-up, and all-rank `new_group` calls (they wait for the whole world).
    """
    found: list[WorldCollective] = []

    def on_world(name: str) -> None:
        stack = "".join(traceback.format_stack()[:-2])
        found.append(WorldCollective(name, stack))
        if not allowed_world:
            raise WorldCollectiveError(f"torch.distributed.{name} on the WORLD group while WORLD collectives "
                                       f"are forbidden; issued from:\n{stack}")

    patches = [(dist, name, _guarded(name, getattr(dist, name), on_world))
               for name in TORCH_COLLECTIVES if hasattr(dist, name)]
    patches.append((dist, "new_group", _guarded_new_group(dist.new_group, on_world)))
    backend = _deepspeed_backend()
    if backend is not None:
        for attribute in ("all_gather_function", "reduce_scatter_function"):
            function = getattr(backend, attribute, None)
            if function is not None:
                patches.append((backend, attribute, _guarded(attribute, function, on_world)))
    with _patched(patches):
        yield found


def _deepspeed_backend():
    """deepspeed's communication backend object, if deepspeed is imported and initialised."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None
