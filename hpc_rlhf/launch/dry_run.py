"""`hpc-rlhf MODE --config FILE --dry-run --world-size N --gpus-per-node G [--model PRESET]`: would this config
start on that allocation? Checked completely without model files, data or GPUs, in a second.

What it checks, in order (the first problem ends it, as one line naming the key or flag):
1. keys and values: the mode's config loader (unknown keys, types, ranges, the mode's own relations between
   keys, RL batch sizes against the role groups), done by the CLI before this module runs;
2. the world: an RL config's placement on N ranks of G per node (roles that add up, engines that stay inside a
   node, the roles the config needs, tensor parallelism the rollout backend can do, `ranks_per_node`); a
   one-model mode's `dist.nproc` against N and its batch size against N data-parallel ranks;
3. the memory plan: every role's GPU memory per rank (hpc_rlhf.dist.allocation, the check `hpc-rlhf plan`
   makes) from the model's shape and the config's ZeRO stage, Adam offload, micro batch, sequence length and
   vLLM memory share, against `--gpu-memory-gb`.
Model shapes come from the config's model folders (their config.json) or, for a folder that is not there (a
placeholder), from `--model` (a preset such as 70b, or a config.json). Data files are not read.

`check_config` is the function other commands call (sbatch/common.sh runs it through the CLI before any rank
starts; a simulation of a job starts from it): it returns the allocation report or raises AllocationError.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_rlhf.config import ConfigError
from hpc_rlhf.dist.allocation import (Allocation, AllocationError, RoleLoad, check_allocation, plan_on, public,
                                     refusal)
from hpc_rlhf.dist.memory import PROJECTIONS, ModelShape, ModelShapeError, load_shape
from hpc_rlhf.dist.plan_cli import format_report, refuse
from hpc_rlhf.launch import preflight
from hpc_rlhf.scale import communicators

DEFAULT_REQUEUE_MARGIN_S = 120.0  # sbatch/common.sh's REQUEUE_MARGIN_S
DEFAULT_CHECKPOINT_GBPS = 2.0  # GB/s one node writes to a parallel file system: an assumption, CHECKPOINT_GBPS
ALLOCATION_FLAGS = {"world_size": "--world-size", "gpus_per_node": "--gpus-per-node",
                    "gpu_memory_gb": "--gpu-memory-gb", "host_memory_gb": "--host-memory-gb"}
# One-model modes: what sits on each rank of their single data-parallel group, and the memory model's kind of
# the trained model (a reward model is a value model: no LM head).
PAIRED_WITH_REFERENCE = ("dpo", "kto", "idpo")
WITH_TEACHER = ("kd",)  # a frozen teacher on every rank beside the trained model
VALUE_MODEL_MODES = ("rm",)
INFERENCE_MODES = ("generate",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The dry run's flags on a training mode's parser (hpc_rlhf.cli)."""
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config for an allocation (--world-size, --gpus-per-node) and exit")
    parser.add_argument("--world-size", type=int, default=None, help="dry run: total ranks (GPUs)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="dry run: ranks per node")
    parser.add_argument("--model", default=None,
                        help="dry run: the model shape of every role whose model folder has no config.json (a "
                             "placeholder): a preset (7b, 13b, 34b, 70b) or a config.json")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="dry run: memory of one GPU")
    parser.add_argument("--host-memory-gb", type=float, default=None,
                        help="dry run: memory of one node, for the offloaded optimizer states and the ranks' "
                             "processes (default: not checked; sbatch/common.sh gives the job's)")
    parser.add_argument("--stop-lead-s", type=float, default=None,
                        help="dry run: seconds between Slurm's stop signal and the time limit (--signal=USR1@LEAD): "
                             "warns when the last step and the checkpoint may not fit in it (default: not checked)")
    parser.add_argument("--requeue-margin-s", type=float, default=DEFAULT_REQUEUE_MARGIN_S,
                        help="dry run: the requeue guard's margin before the time limit (REQUEUE_MARGIN_S)")
    parser.add_argument("--checkpoint-gbps", type=float, default=DEFAULT_CHECKPOINT_GBPS,
                        help="dry run: write speed of one node to output_dir's file system, GB/s")
    parser.add_argument("--step-time-s", type=float, default=0.0,
                        help="dry run: one training step's seconds, when known (the stop waits for the step)")
    parser.add_argument("--check-files", action="store_true",
                        help="dry run: also read the real files (model and tokenizer folders, the first rows of the "
                             "data files, output_dir writable with room for the checkpoints kept, final/ "
                             "and best/); what sbatch/common.sh runs inside the job")
    parser.add_argument("--json", action="store_true", help="dry run: print the report as one JSON object")


def is_rl(cfg: Any) -> bool:
    return hasattr(cfg, "placement") and hasattr(cfg, "rollout")


@dataclass
class ModelFolders:
    """Every model folder a plan read (config key -> folder), and those of them sized by `--model` instead because
    they are not there yet (placeholders)."""
    read: dict[str, str] = field(default_factory=dict)
    stand_ins: dict[str, str] = field(default_factory=dict)


def _shape(folder: str | None, key: str, preset: str | None, folders: ModelFolders) -> ModelShape:
    """The shape of the model in `folder` (its config.json), or of `preset` when the folder is not there yet
    (recorded in `folders.stand_ins`, for the report)."""
    folders.read[key] = str(folder)
    if folder and Path(folder).is_dir() and (Path(folder) / "config.json").is_file():
        try:
            return ModelShape.from_config_json(folder)
        except ModelShapeError as exc:
            raise AllocationError(key, str(exc)) from None
    if preset is not None:
        try:
            shape = load_shape(preset)
        except ModelShapeError as exc:
            raise AllocationError("--model", str(exc)) from None
        folders.stand_ins[key] = str(folder)
        return shape
    raise AllocationError(key, f"'{folder}' is not a model folder with a config.json (a placeholder?): give its "
                               f"shape with --model (7b, 13b, 34b, 70b or a config.json)")


def _dtype_bytes(model_section) -> int:
    return 4 if model_section.dtype == "float32" else 2  # auto = bfloat16 on GPU


def _rl_loads(cfg: Any, plan, model: str | None, folders: ModelFolders):
    actor = _shape(cfg.actor.path, "actor.path", model, folders)
    shapes = {"actor": actor, "ref": _shape(cfg.ref_path, "ref_path", model, folders) if cfg.ref_path else actor,
              "rollout": actor}
    if plan.has("critic"):
        shapes["critic"] = _shape(cfg.critic.path, "critic.path", model, folders)
    if plan.has("teacher"):
        shapes["teacher"] = _shape(cfg.distill.teacher, "distill.teacher", model, folders)
    model_keys = {"actor": "actor.path", "ref": "ref_path" if cfg.ref_path else "actor.path",
                  "critic": "critic.path", "teacher": "distill.teacher"}
    for index, name in enumerate(n for n in plan.roles if plan.roles[n].kind == "reward"):
        shapes[name] = _shape(cfg.reward.models[index], f"reward.models[{index}]", model, folders)
        model_keys[name] = f"reward.models[{index}]"
    for name in plan.roles:
        if plan.sequence_parallel(name) > 1:
            _check_heads(plan, name, shapes[name], model_keys[name], folders)
    rollout = plan.roles.get("rollout")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples
    per_engine = math.ceil(samples / len(rollout.engines)) if rollout else 0
    if cfg.rollout.backend == "hf":  # generate() takes at most max_batch_prompts prompts at once
        per_engine = min(per_engine, cfg.rollout.max_batch_prompts * cfg.rollout.n_samples)

    # a LoRA actor: the memory model knows the usual projections (other module names add nothing it can size)
    lora = ({"lora_rank": cfg.actor.lora.rank,
             "lora_targets": tuple(t for t in cfg.actor.lora.target_modules if t in PROJECTIONS)}
            if cfg.actor.lora.rank > 0 else {})

    def load_of(name: str, kind: str) -> RoleLoad:
        section, train, prefix = ((cfg.critic, cfg.critic_train, "critic_train") if kind == "critic"
                                  else (cfg.actor, cfg.train, "train"))
        # Training roles' passes are cut by rl.micro_batch_tokens, the scoring roles' by rl.score_micro_batch_tokens
        # (falling back to the other); a training role's scoring passes hold about a fifth of a training pass's
        # activations per token, so its training budget is the one that sizes it.
        scores_only = kind not in ("actor", "critic")
        budget_key = "rl.score_micro_batch_tokens" if scores_only and cfg.rl.score_micro_batch_tokens \
            else "rl.micro_batch_tokens"
        budget = cfg.rl.score_micro_batch_tokens if budget_key == "rl.score_micro_batch_tokens" \
            else cfg.rl.micro_batch_tokens
        keys = {"zero_stage": f"{prefix}.zero_stage", "adam_offload": f"{prefix}.adam_offload",
                "micro_batch_size": f"{prefix}.micro_batch_size", "micro_batch_tokens": budget_key,
                "gradient_checkpointing": f"{'critic' if kind == 'critic' else 'actor'}.gradient_checkpointing",
                "rollout_tp": "placement", "share": "rollout.gpu_memory_utilization",
                "tokens_in_flight": "rollout.prompts_per_step x rollout.n_samples", "sequence_parallel": "placement"}
        vllm = kind == "rollout" and cfg.rollout.backend == "vllm"
        return RoleLoad(kind=kind, shape=shapes[name], zero_stage=train.zero_stage, adam_offload=train.adam_offload,
                        micro_batch_size=train.micro_batch_size, seq_len=cfg.data.max_len,
                        micro_batch_tokens=0 if kind == "rollout" else budget,
                        gradient_checkpointing=section.gradient_checkpointing,
                        tokens_in_flight=per_engine * cfg.data.max_len, dtype_bytes=_dtype_bytes(section),
                        weight_sync_bucket_mb=cfg.rollout.weight_sync_bucket_mb if rollout else 0.0,
                        gpu_share=cfg.rollout.gpu_memory_utilization if vllm else None, keys=keys,
                        # a hybrid vLLM engine sleeps while the actor trains: its weights wait in host memory
                        sleeps_on_host=vllm and plan.is_hybrid,
                        **(lora if kind in ("actor", "rollout") else {}))

    return load_of


def _check_heads(plan, name: str, shape: ModelShape, key: str, folders: ModelFolders) -> None:
    """K ranks sharing a row exchange attention heads by all-to-all, each ending with H/K query heads of the whole
    row, so K must divide H. Key/value heads K does not divide travel repeated to one per query head
    (hpc_rlhf/models/sequence_parallel.py; the memory model counts those bytes), so their count is no refusal."""
    k, sp_key = plan.sequence_parallel(name), f"{plan.role(name).kind}_sp"
    if shape.heads % k == 0:
        return
    folder = folders.read[key]
    source = f"{key}={folder}" + (" (sized by --model)" if key in folders.stand_ins else "")
    raise AllocationError("placement", f"{sp_key}={k} does not divide the {shape.heads} attention heads of {name}'s "
                                       f"model ({shape.kv_heads} key/value heads), {source}: the {k} ranks sharing "
                                       f"a row split its heads; choose a {sp_key} that divides {shape.heads}")


def _check_rl(cfg: Any, plan, allocation: Allocation) -> None:
    """The RL checks that need the allocation's node size (the config loader checked the rest on one node)."""
    from hpc_rlhf.rl.config import check_plan_against_config  # the RL recipe's code: only RL modes need it

    if cfg.ranks_per_node and cfg.ranks_per_node != allocation.gpus_per_node:
        raise AllocationError("ranks_per_node", f"is {cfg.ranks_per_node} but the allocation has "
                                                f"{allocation.gpus_per_node} ranks per node (--gpus-per-node); "
                                                f"leave it 0 to take the launcher's")
    try:
        check_plan_against_config(plan, cfg)
    except ConfigError as exc:
        first, _, rest = str(exc).partition("\n")
        raise AllocationError("placement", first.removeprefix(f"placement '{cfg.placement}': "), rest) from None


def _one_model(mode: str, cfg: Any, allocation: Allocation, model: str | None, folders: ModelFolders):
    world = allocation.world_size
    if cfg.dist.nproc != world:
        raise AllocationError("dist.nproc", f"is {cfg.dist.nproc} but the allocation has {world} ranks "
                                            f"(--world-size); the sbatch scripts pass dist.nproc=$SLURM_NTASKS")
    train = getattr(cfg, "train", None)
    if train is not None and train.batch_size % (train.micro_batch_size * world):
        raise AllocationError("train.batch_size", f"{train.batch_size} must be a multiple of train.micro_batch_size "
                                                  f"({train.micro_batch_size}) x {world} ranks = "
                                                  f"{train.micro_batch_size * world}")
    with_ref = mode in PAIRED_WITH_REFERENCE and cfg.ref.mode == "colocated"
    with_teacher = mode in WITH_TEACHER
    placement = f"actor+ref={world}" if with_ref else f"actor+teacher={world}" if with_teacher else f"actor={world}"
    shapes = {"actor": _shape(cfg.model.path, "model.path", model, folders)}
    if with_ref:
        shapes["ref"] = _shape(cfg.ref.path, "ref.path", model, folders) if cfg.ref.path else shapes["actor"]
    if with_teacher:
        shapes["teacher"] = _shape(cfg.kd.teacher, "kd.teacher", model, folders)
    memory_kind = "critic" if mode in VALUE_MODEL_MODES else "ref" if mode in INFERENCE_MODES else "actor"

    def load_of(name: str, kind: str) -> RoleLoad:
        trained = train is not None and name == "actor"
        keys = {"zero_stage": "train.zero_stage", "adam_offload": "train.adam_offload",
                "micro_batch_size": "train.micro_batch_size", "gradient_checkpointing": "model.gradient_checkpointing"}
        return RoleLoad(kind=memory_kind if name == "actor" else kind, shape=shapes[name],
                        zero_stage=train.zero_stage if train else 0, adam_offload=trained and train.adam_offload,
                        micro_batch_size=train.micro_batch_size if train else 1, seq_len=cfg.data.max_len,
                        gradient_checkpointing=cfg.model.gradient_checkpointing,
                        dtype_bytes=_dtype_bytes(cfg.model), keys=keys)

    return placement, load_of


def check_config(mode: str, cfg: Any, world_size: int, gpus_per_node: int, model: str | None = None,
                 gpu_memory_gb: float = 80.0, host_memory_gb: float | None = None) -> dict:
    """The allocation report of a loaded config (`hpc_rlhf.config.load_config`, which has checked keys and
    values) on `world_size` ranks of `gpus_per_node` per node; raises AllocationError, one line naming the key or
    flag, when the config would not start there. `report["fits"]` is False when a role's memory does not fit
    (`refusal(report)` says which and what to change): the CLI refuses such a config too."""
    allocation = Allocation(world_size, gpus_per_node, gpu_memory_gb, host_memory_gb=host_memory_gb,
                            keys=ALLOCATION_FLAGS)
    if world_size < 1 or gpus_per_node < 1:
        key = "world_size" if world_size < 1 else "gpus_per_node"
        raise AllocationError(ALLOCATION_FLAGS[key], f"must be at least 1, got {getattr(allocation, key)}")
    folders = ModelFolders()
    if is_rl(cfg):
        if cfg.world_size() != world_size:
            raise AllocationError("placement", f"'{cfg.placement}' asks for {cfg.world_size()} ranks but the "
                                               f"allocation has {world_size} (--world-size)")
        plan = plan_on(cfg.placement, allocation, "placement")
        _check_rl(cfg, plan, allocation)
        report = check_allocation(cfg.placement, allocation, _rl_loads(cfg, plan, model, folders),
                                  placement_key="placement",
                                  extra_gb_of=lambda p: communicators.buffers_gb(p, cfg.train.zero_stage))
    else:
        placement, load_of = _one_model(mode, cfg, allocation, model, folders)
        zero_stage = cfg.train.zero_stage if hasattr(cfg, "train") else 0
        report = check_allocation(placement, allocation, load_of, placement_key="dist.nproc",
                                  extra_gb_of=lambda p: communicators.buffers_gb(p, zero_stage))
    report["stand_in_shapes"] = folders.stand_ins  # model folders not there yet, sized by --model
    report["model_folders"] = folders.read
    return report


def checkpoint_per_node_gb(report: dict) -> list[float]:
    """GB each node writes for one checkpoint: every trained role's rank writes its optimizer states (on the GPU or
    offloaded) and, under ZeRO-3, its shard of the weights; with whole weights per rank, the role's first rank
    writes them."""
    per_node = [0.0] * report["nodes"]
    for row in report["roles"].values():
        gb = row["breakdown_gb"]
        optimizer = gb.get("optimizer", 0.0) + gb.get("cpu_optimizer", 0.0)
        if optimizer <= 0:  # not trained: nothing of it in a checkpoint
            continue
        for index, rank in enumerate(row["ranks"]):
            weights = gb["weights"] if report["zero_stage"] == 3 or index == 0 else 0.0
            per_node[rank // report["ranks_per_node"]] += optimizer + weights
    return per_node


def check_stop_lead(report: dict, lead_s: float, margin_s: float, gbps: float, step_s: float = 0.0) -> dict:
    """Whether the ranks can finish their step and write their checkpoint between Slurm's stop signal (`lead_s`
    before the time limit) and the requeue guard (`margin_s` before it), at `gbps` per node. Raises AllocationError
    for a margin that leaves no time at all."""
    for flag, value in (("--stop-lead-s", lead_s), ("--checkpoint-gbps", gbps)):
        if value <= 0:
            raise AllocationError(flag, f"must be positive, got {value:g}")
    if margin_s < 0 or margin_s >= lead_s:
        raise AllocationError("--requeue-margin-s", f"{margin_s:g} s must be at least 0 and less than the stop "
                                                    f"signal's lead ({lead_s:g} s, --stop-lead-s): the guard would "
                                                    f"requeue the job before its ranks could stop")
    per_node = checkpoint_per_node_gb(report)
    write_s = max(per_node) / gbps
    return {"gb_per_node": [round(gb, 1) for gb in per_node], "write_s": round(write_s, 1), "gbps": gbps,
            "step_s": step_s, "lead_s": lead_s, "margin_s": margin_s,
            "enough": step_s + write_s <= lead_s - margin_s}


def stop_lead_line(stop: dict) -> str:
    need = f"a checkpoint of up to {max(stop['gb_per_node']):,.0f} GB per node at {stop['gbps']:g} GB/s: " \
           f"{stop['write_s']:.0f} s" + (f", after a step of {stop['step_s']:.0f} s" if stop["step_s"] else
                                         ", after the step in progress")
    window = f"{stop['lead_s'] - stop['margin_s']:.0f} s between the stop signal ({stop['lead_s']:.0f} s before " \
             f"the limit) and the requeue guard ({stop['margin_s']:.0f} s before it)"
    if stop["enough"]:
        return f"stop: {need}; {window}"
    return (f"warning: the stop signal's lead is too short for {need}; only {window}: the job would be requeued "
            f"before the checkpoint is complete and resume from the one before; give the stop signal a lead of at "
            f"least {stop['step_s'] + stop['write_s'] + stop['margin_s']:.0f} s"
            + ("" if stop["step_s"] else " plus one step (--step-time-s)")
            + " (#SBATCH --signal=USR1@LEAD and STOP_LEAD_S)")


def main(mode: str, cfg: Any, args: argparse.Namespace) -> int:
    """The CLI's dry run: the report on stdout and exit 0, or one line on stderr and exit 2."""
    prog = f"hpc-rlhf {mode} --dry-run"
    missing = [flag for flag, value in (("--world-size", args.world_size), ("--gpus-per-node", args.gpus_per_node))
               if value is None]
    if missing:
        print(f"{prog}: {missing[0]} is needed (the allocation to check the config for)", file=sys.stderr)
        return 2
    try:
        report = check_config(mode, cfg, args.world_size, args.gpus_per_node, args.model, args.gpu_memory_gb,
                              args.host_memory_gb)
        if args.stop_lead_s is not None:
            report["stop"] = check_stop_lead(report, args.stop_lead_s, args.requeue_margin_s, args.checkpoint_gbps,
                                             args.step_time_s)
        if args.check_files:
            report["files"] = preflight.check_files(cfg, report, sum(checkpoint_per_node_gb(report)))
    except AllocationError as exc:
        return refuse(prog, exc)
    print(json.dumps(public(report)) if args.json else format_report(report))
    if "files" in report and not args.json:
        print("files checked:\n  " + "\n  ".join(report["files"]))
    if "stop" in report and not args.json:
        print(stop_lead_line(report["stop"]), file=sys.stdout if report["stop"]["enough"] else sys.stderr)
    if report["stand_in_shapes"] and not args.json:
        print(f"note: sized by --model {args.model} (these folders are not there yet): "
              + ", ".join(f"{key}={folder}" for key, folder in report["stand_in_shapes"].items()))
    reason = refusal(report)
    if reason is not None:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    return 0
