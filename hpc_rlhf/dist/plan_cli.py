"""The table of `hpc-rlhf plan` (its command is hpc_rlhf.scale.plan): the role placement and a per-rank memory
estimate from the command's flags, without starting anything.

Meant for a login node before queueing a large job: it imports neither torch.distributed nor DeepSpeed.
"""

from __future__ import annotations

import argparse
import sys

from hpc_rlhf.dist.allocation import BREAKDOWN, Allocation, AllocationError, RoleLoad, check_allocation
from hpc_rlhf.dist.memory import (DEFAULT_LORA_TARGETS, DEFAULT_OVERHEAD_GB, GB, HOST_OVERHEAD_GB, PROJECTIONS,
                                 ModelShape,
                                  ModelShapeError, load_shape)
from hpc_rlhf.dist.placement import format_ranks, format_rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc-rlhf plan", description="Print the role placement and the GPU memory each rank needs.",
        epilog="example: hpc-rlhf plan --world-size 32 --gpus-per-node 8 --model 70b "
               "--placement actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4")
    parser.add_argument("--world-size", type=int, required=True, help="total ranks (GPUs)")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node")
    parser.add_argument("--placement", required=True,
                        help="e.g. actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2")
    parser.add_argument("--model", required=True,
                        help="preset (7b, 13b, 34b, 70b) or a model folder / config.json; used by every role")
    parser.add_argument("--critic-model", default=None, help="critic shape if it differs from --model")
    parser.add_argument("--reward-model", default=None, help="reward model shape if it differs from --model")
    parser.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    parser.add_argument("--adam-offload", action="store_true", help="Adam states in CPU memory")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU (GB = 1e9 bytes)")
    parser.add_argument("--host-memory-gb", type=float, default=None,
                        help="memory of one node: the offloaded optimizer states and the ranks' processes are "
                             "checked against it (default: not checked)")
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="sequences per rank in one training or scoring pass")
    parser.add_argument("--micro-batch-tokens", type=int, default=0,
                        help="passes cut by this many tokens instead of --micro-batch-size sequences "
                             "(rl.micro_batch_tokens; a longer sequence alone; 0 = by sequences)")
    parser.add_argument("--seq-len", type=int, default=2048, help="prompt + response tokens of a sequence")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep every layer's activations while training")
    parser.add_argument("--rollout-seqs", type=int, default=128,
                        help="sequences one rollout engine generates at once (its KV cache holds them)")
    parser.add_argument("--overhead-gb", type=float, default=DEFAULT_OVERHEAD_GB,
                        help="per-rank allowance for the CUDA context and fragmentation (NCCL buffers: counted apart)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="the actor trains a LoRA adapter of this rank (0: full fine-tuning); its reference is "
                             "then the actor with the adapter off, so the placement needs no ref role")
    parser.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS),
                        help="projections the adapter is on, comma-separated (of q_proj, k_proj, v_proj, o_proj, "
                             "gate_proj, up_proj, down_proj)")
    return parser


def _load(model: str, flag: str) -> ModelShape:
    try:
        return load_shape(model)
    except ModelShapeError as exc:
        raise AllocationError(flag, str(exc)) from None


# What each flag of this command is called in a refusal (hpc_rlhf.dist.allocation names the one to change).
FLAG_NAMES = {"zero_stage": "--zero-stage", "adam_offload": "--adam-offload", "micro_batch_size": "--micro-batch-size",
              "micro_batch_tokens": "--micro-batch-tokens",
              "rollout_tp": "--placement", "tokens_in_flight": "--rollout-seqs", "sequence_parallel": "--placement"}


def compute(args: argparse.Namespace, extra_gb_of=None) -> dict:
    """The plan and its memory estimate (hpc_rlhf.dist.allocation.check_allocation, the check a training mode's
    --dry-run makes too), from this command's flags; `extra_gb_of`: as check_allocation's (the communicators'
    buffers, which `hpc-rlhf plan` adds: hpc_rlhf.scale.plan)."""
    shape = _load(args.model, "--model")
    shapes = {"critic": _load(args.critic_model, "--critic-model") if args.critic_model else shape,
              "reward": _load(args.reward_model, "--reward-model") if args.reward_model else shape}

    lora = {"lora_rank": args.lora_rank, "lora_targets": _targets(args)} if args.lora_rank > 0 else {}

    def load_of(name: str, kind: str) -> RoleLoad:
        return RoleLoad(kind=kind, shape=shapes.get(kind, shape), zero_stage=args.zero_stage,
                        adam_offload=args.adam_offload, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                        micro_batch_tokens=0 if kind == "rollout" else args.micro_batch_tokens,
                        gradient_checkpointing=not args.no_gradient_checkpointing,
                        tokens_in_flight=args.rollout_seqs * args.seq_len, keys=FLAG_NAMES,
                        **(lora if kind in ("actor", "rollout") else {}))

    allocation = Allocation(args.world_size, args.gpus_per_node, args.gpu_memory_gb, args.overhead_gb,
                            host_memory_gb=args.host_memory_gb)
    result = check_allocation(args.placement, allocation, load_of, extra_gb_of=extra_gb_of)
    if lora:
        adapter = shape.lora_params(args.lora_rank, lora["lora_targets"])
        result["lora"] = {"rank": args.lora_rank, "targets": list(lora["lora_targets"]), "params": adapter,
                          "share_of_model": adapter / shape.num_params,
                          "sync_gb": 2 * adapter / GB, "full_sync_gb": 2 * shape.num_params / GB}
    return result


def _targets(args: argparse.Namespace) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown or not targets:
        raise AllocationError("--lora-targets", f"{unknown or 'nothing'} given; the adapter goes on projections "
                                                f"among {', '.join(PROJECTIONS)}")
    return targets


def format_report(result: dict) -> str:
    rows = [(name, format_ranks(r["ranks"]), format_ranks(r["nodes"]), ", ".join(r["groups"]),
             f"{r['memory_gb_per_rank']:.1f}", f"{r['own_memory_gb']:.1f}", "yes" if r["fits"] else "NO")
            for name, r in result["roles"].items()]
    table = format_rows(("role", "ranks", "nodes", "groups", "GB/rank", "own GB", "fits"), rows)
    breakdown = format_rows(("role",) + BREAKDOWN + ("cpu (offload)",),
                            [(name,) + tuple(f"{v:.2f}" for v in r["breakdown_gb"].values())
                             for name, r in result["roles"].items()])
    model = result["model"]
    head = (f"{result['world_size']} ranks on {result['nodes']} node(s) of {result['ranks_per_node']}; "
            f"model {model['name']} ({model['params'] / 1e9:.2f}B parameters); ZeRO-{result['zero_stage']}, "
            f"Adam offload {'on' if result['adam_offload'] else 'off'}; {result['gpu_memory_gb']:g} GB per GPU")
    if "lora" in result:
        lora = result["lora"]
        head += (f"\nLoRA rank {lora['rank']} on {', '.join(lora['targets'])}: {lora['params'] / 1e6:.1f}M trained "
                 f"parameters ({100 * lora['share_of_model']:.2f}% of the model); a weight sync moves "
                 f"{lora['sync_gb'] * 1e3:.0f} MB (bf16) instead of {lora['full_sync_gb']:.1f} GB; the reference is "
                 "the actor with its adapter off (no ref role needed)")
    verdict = "the plan fits" if result["fits"] else "the plan does NOT fit: see the rows marked NO" \
        if not all(r["fits"] for r in result["roles"].values()) else "the plan does NOT fit: host memory"
    return (f"{head}\n\n{table}\n\nper-role GB per rank (GB/rank adds colocated roles and "
            f"{result['overhead_gb']:g} GB overhead):\n{breakdown}\n\n{host_line(result['host'])}\n\n{verdict}")


def host_line(host: dict) -> str:
    """The line `hpc-rlhf plan` and `hpc-rlhf simulate` print for a report's `host` (check_allocation's)."""
    limit = f"node memory {host['limit_gb']:g} GB" if host["limit_gb"] is not None else \
        "node memory not given (--host-memory-gb): not checked"
    return (f"host memory per node (offloaded optimizer states, sleeping engines' weights, "
            f"{HOST_OVERHEAD_GB:g} GB per rank's process): "
            + ", ".join(f"node {n} {gb:,.0f} GB" for n, gb in enumerate(host["gb_per_node"]))
            + f"; {limit}" + ("" if host["fits"] else ": does NOT fit"))


def refuse(prog: str, exc: AllocationError) -> int:
    """A refusal as every check prints it: one line on stderr naming the setting, what shows why on stdout."""
    print(f"{prog}: {exc}", file=sys.stderr)
    if exc.detail:
        print(exc.detail)
    return 2
