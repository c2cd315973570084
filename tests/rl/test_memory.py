"""Memory discipline of the RL step under ZeRO-3 (no timing): no phase materialises more than one module's
parameters at once on a rank, and the actor leader's weight sync holds no more than one module plus two buckets.

Two real runs through the command line under torchrun, one RL step and one evaluation each, every trained and
frozen model under ZeRO-3 with `stage3_param_persistence_threshold` 0 (so every parameter is partitioned,
DESIGN §9) and DeepSpeed's own gathering window set to 0 (no prefetch, nothing kept for reuse), so that "one
module" is exactly the bound:

  disjoint (4 ranks, PPO): actor on 2 ranks, critic + ref colocated on 1, one rollout engine; scoring by the
      trained roles through their forward, training, weight sync streamed to the engine, evaluation.
  hybrid (2 ranks, GRPO): actor on 2 ranks with `rollout@actor`: the hf engine generates with the actor's own
      sharded module, layer by layer, the two ranks decoding in step; scoring, training, evaluation.

There is no exception: hybrid generation is held to the same bound as every other phase.

What is counted, deterministically, on every rank (worker code at the bottom of this file):
  gathered   bytes of the ZeRO-3 parameters whose status is AVAILABLE (whole on this rank), summed over every
             ZeRO-3 model of the rank, sampled after every module forward, after every DeepSpeed fetch
             (forward and backward), on entering every `GatheredParameters` block and at every broadcast of
             the weight sync; the largest per phase (the watchdog's phase names) must not exceed the largest
             single module's own parameters ("unit").
  sync       on the actor leader during the weight sync: bytes of every CPU storage created during the sync and
             still referenced (a TorchDispatchMode sees every tensor the sync makes: copies, bucket buffers,
             gathered modules), sampled at every broadcast; must not exceed one unit plus two 1 MB buckets.

On the code before the streaming sync and layer-by-layer hybrid generation, the hybrid case fails (generation
gathered the whole 4 MB actor on both ranks) and the disjoint case fails (a ZeRO-3 actor's bare-module forward
issued WORLD broadcasts, and the leader's sync held a whole CPU copy of the weights).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hpc_rlhf.config import TINY_ASSETS

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"
BUCKET_MB = 1
ROOM = 16 * 1024  # what a 1 MB bucket buffer holds besides the bucket: its description (dist/weight_sync.py)
SLACK = 64 * 1024  # headers, bucket descriptions and other small tensors of the sync
COMMON = [f"actor.path={TINY_MODEL}", "train.max_steps=1", "train.zero_stage=3",
          "train.zero3_param_persistence_threshold=0", "rollout.prompts_per_step=4", "rollout.n_samples=4",
          "train.batch_size=16", "train.micro_batch_size=8", "log.eval_every_steps=1", "eval.max_rows=8",
          f"rollout.weight_sync_bucket_mb={BUCKET_MB}", "log.progress=false", "log.tensorboard=false",
          "checkpoint.every_steps=0", "checkpoint.resume=false"]
CASES = {
    "disjoint": (4, ["ppo", "--config", "examples/tiny/ppo.yaml", "placement=actor=2,critic+ref=1,rollout=1",
                     f"critic.path={TINY_MODEL}", "reward.models=[]", "reward.functions=[exact_match]",
                     "critic_train.zero_stage=3", "critic_train.zero3_param_persistence_threshold=0",
                     "critic_train.batch_size=16", "critic_train.micro_batch_size=8", *COMMON],
                 ("scoring", "training", "weight_sync")),
    "hybrid": (2, ["grpo", "--config", "examples/tiny/grpo.yaml", "placement=actor=2,rollout@actor",
                   "rl.kl_coef=0", *COMMON],
               ("rollout", "scoring", "training", "eval")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_phase_holds_more_than_one_module(tmp_path, case):
    from tests.distributed import run_ranks

    ranks, args, phases = CASES[case]
    run_ranks(ranks, __file__, str(tmp_path), *args, f"output_dir={tmp_path / 'run'}", timeout=400)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    over = []
    for rank, report in enumerate(reports):
        unit = report["unit"]
        if unit == 0:
            continue  # no ZeRO-3 model on this rank (a rollout rank of the disjoint layout)
        for phase, peak in report["gathered"].items():
            if peak > unit:
                over.append(f"rank {rank}, phase {phase}: {peak} bytes gathered at once, one module is at most "
                            f"{unit}")
        buckets = 2 * (BUCKET_MB * 2**20 + ROOM)
        if report["sync_live"] is not None and report["sync_live"] > unit + buckets + SLACK:
            over.append(f"rank {rank}, weight sync: the leader held {report['sync_live']} bytes at once, the bound "
                        f"is one module ({unit}) + two buckets ({buckets}) + {SLACK}")
    assert not over, "\n".join(over)
    # the measurement saw what it claims to bound: every phase gathered something on the actor's ranks
    actor_ranks = reports[:2]
    for phase in phases:
        assert all(0 < r["gathered"].get(phase, 0) for r in actor_ranks), (phase, [r["gathered"] for r in actor_ranks])
    if case == "disjoint":
        assert reports[0]["sync_live"] > 2**20  # the leader packed (and held) at least one bucket


# ------------------------------------------------------------------------------------------------ worker
def worker(out: Path, args: list[str]) -> int:
    import weakref

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from hpc_rlhf import cli
    from hpc_rlhf.dist import watchdog
    from hpc_rlhf.rl import sync as rl_sync

    watched: list[torch.nn.Module] = []  # the top modules of this rank's ZeRO-3 models
    report = {"gathered": {}, "unit": 0, "sync_live": None}

    initialize = deepspeed.initialize

    def zero3_without_window(*a, **kw):
        zero = kw["config"].get("zero_optimization", {})
        if zero.get("stage") == 3:
            zero.update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
        result = initialize(*a, **kw)
        if zero.get("stage") == 3:
            module = result[0].module
            watched.append(module)
            unit = max(sum(p.ds_numel * p.element_size() for p in m.parameters(recurse=False))
                       for m in module.modules())
            report["unit"] = max(report["unit"], unit)
        return result

    deepspeed.initialize = zero3_without_window

    def gathered() -> int:
        seen, total = set(), 0
        for module in watched:
            for p in module.parameters():
                if id(p) not in seen and getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE:
                    seen.add(id(p))
                    total += p.ds_numel * p.element_size()
        return total

    def record(*_):
        if watched:
            phase = watchdog.current_phase() or "setup"
            report["gathered"][phase] = max(report["gathered"].get(phase, 0), gathered())

    torch.nn.modules.module.register_module_forward_hook(record)
    fetch = PartitionedParameterCoordinator.fetch_sub_module

    def fetch_and_record(self, *a, **kw):
        fetch(self, *a, **kw)
        record()

    PartitionedParameterCoordinator.fetch_sub_module = fetch_and_record
    enter = deepspeed.zero.GatheredParameters.__enter__

    def enter_and_record(self):
        result = enter(self)
        record()
        return result

    deepspeed.zero.GatheredParameters.__enter__ = enter_and_record

    class LiveBytes(TorchDispatchMode):
        """CPU storages created while active and still referenced by a tensor made while active."""

        def __init__(self):
            super().__init__()
            self.storages: dict[int, list] = {}  # data_ptr -> [nbytes, weak references]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
                    storage = t.untyped_storage()
                    entry = self.storages.get(storage.data_ptr())
                    if entry is None or not any(ref() is not None for ref in entry[1]):
                        entry = self.storages[storage.data_ptr()] = [0, []]
                    entry[0] = max(entry[0], storage.nbytes())
                    entry[1].append(weakref.ref(t))
            return result

        def live(self) -> int:
            return sum(n for n, refs in self.storages.values() if any(ref() is not None for ref in refs))

    sync = rl_sync.WeightSync.sync
    broadcast = dist.broadcast

    def sync_and_measure(self):
        if self.actor is None or not self.actor.is_leader:
            return sync(self)
        mode = LiveBytes()
        report["sync_live"] = 0

        def measured_broadcast(*a, **kw):
            report["sync_live"] = max(report["sync_live"], mode.live())
            record()
            return broadcast(*a, **kw)

        dist.broadcast = measured_broadcast
        try:
            with mode:
                return sync(self)
        finally:
            dist.broadcast = broadcast

    rl_sync.WeightSync.sync = sync_and_measure
    code = cli.main(args)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))  # the run has left the world
    return code


if __name__ == "__main__":
    sys.exit(worker(Path(sys.argv[1]), sys.argv[2:]))
