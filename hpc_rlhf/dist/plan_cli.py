"""`hpc-rlhf plan`: the role placement and a per-rank memory estimate, without starting anything.

Meant for a login node before queueing a large job: it imports neither torch.distributed nor DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import sys

from hpc_rlhf.dist.memory import DEFAULT_OVERHEAD_GB, ModelShape, ModelShapeError, estimate, load_shape
from hpc_rlhf.dist.placement import Plan, PlacementError, format_ranks, format_rows, make_plan

BREAKDOWN = ("weights", "gradients", "optimizer", "activations", "kv_cache", "overhead")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc-rlhf plan", description="Print the role placement and the GPU memory each rank needs.",
        epilog="example: hpc-rlhf plan --world-size 32 --gpus-per-node 8 --model 70b "
               "--placement actor=4,critic=4,ref=4,reward=4,rollout=16,rollout_tp=4")
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
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="sequences per rank in one training or scoring pass")
    parser.add_argument("--seq-len", type=int, default=2048, help="prompt + response tokens of a sequence")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep every layer's activations while training")
    parser.add_argument("--rollout-seqs", type=int, default=128,
                        help="sequences one rollout engine generates at once (its KV cache holds them)")
    parser.add_argument("--overhead-gb", type=float, default=DEFAULT_OVERHEAD_GB,
                        help="per-rank allowance for the CUDA context and fragmentation (NCCL buffers: counted apart)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def _groups_text(plan: Plan, name: str) -> list[str]:
    """The role and weight-sync groups a role takes part in (those hpc_rlhf.dist.groups creates; a rollout role
    has none of its own, its engines are listed, and the experience routes are left out)."""
    role = plan.role(name)
    groups = [f"{len(role.engines)} engine(s) of {len(role.engines[0])}"] if role.kind == "rollout" \
        else [f"role({role.size})"]
    if plan.has("rollout") and (role.kind == "rollout" or name == "actor"):
        sync_size = len(set(plan.role("rollout").ranks) | {plan.role("actor").leader})
        groups.append(f"weight-sync({sync_size})" + (" leader" if name == "actor" else ""))
    return groups


def _load(model: str, flag: str) -> ModelShape:
    try:
        return load_shape(model)
    except ModelShapeError as exc:
        raise ModelShapeError(f"{flag}: {exc}") from None


def compute(args: argparse.Namespace) -> dict:
    """The plan and its memory estimate as the JSON-ready dictionary that `--json` prints."""
    plan = make_plan(args.placement, args.world_size, args.gpus_per_node)
    shape = _load(args.model, "--model")
    shapes = {"critic": _load(args.critic_model, "--critic-model") if args.critic_model else shape,
              "reward": _load(args.reward_model, "--reward-model") if args.reward_model else shape}
    own: dict[str, dict[str, float]] = {}
    for name, role in plan.roles.items():
        tp = len(role.engines[0]) if role.engines else 1
        own[name] = estimate(role.kind, shapes.get(role.kind, shape), role.size, args.zero_stage,
                             args.adam_offload and role.kind in ("actor", "critic"), tp=tp,
                             micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                             gradient_checkpointing=not args.no_gradient_checkpointing,
                             tokens_in_flight=args.rollout_seqs * args.seq_len, overhead_gb=0.0)
    roles = {}
    for name, role in plan.roles.items():
        # Colocated roles share every rank (placement never overlaps roles partially), so a rank of this
        # role holds every role with the same rank set.
        sharing = [other for other, p in plan.roles.items() if p.ranks == role.ranks]
        per_rank = sum(own[other]["total"] for other in sharing) + args.overhead_gb
        roles[name] = {
            "kind": role.kind, "ranks": list(role.ranks), "nodes": list(role.nodes),
            "colocated_with": role.colocated_with, "engines": [list(e) for e in role.engines],
            "groups": _groups_text(plan, name),
            "memory_gb_per_rank": round(per_rank, 3),
            "own_memory_gb": round(own[name]["total"], 3),
            "breakdown_gb": {k: round(own[name][k], 3) for k in BREAKDOWN if k != "overhead"}
            | {"cpu_optimizer": round(own[name]["cpu_optimizer"], 3)},
            "fits": per_rank <= args.gpu_memory_gb,
        }
    return {
        "world_size": plan.world_size, "ranks_per_node": plan.ranks_per_node, "nodes": plan.num_nodes,
        "model": {"name": shape.name, "params": shape.num_params},
        "zero_stage": args.zero_stage, "adam_offload": args.adam_offload, "gpu_memory_gb": args.gpu_memory_gb,
        "overhead_gb": args.overhead_gb, "roles": roles, "fits": all(r["fits"] for r in roles.values()),
    }


def format_report(result: dict) -> str:
    rows = [(name, format_ranks(r["ranks"]), format_ranks(r["nodes"]), ", ".join(r["groups"]),
             f"{r['memory_gb_per_rank']:.1f}", f"{r['own_memory_gb']:.1f}", "yes" if r["fits"] else "NO")
            for name, r in result["roles"].items()]
    table = format_rows(("role", "ranks", "nodes", "groups", "GB/rank", "own GB", "fits"), rows)
    breakdown = format_rows(("role",) + tuple(k for k in BREAKDOWN if k != "overhead") + ("cpu (offload)",),
                            [(name,) + tuple(f"{v:.2f}" for v in r["breakdown_gb"].values())
                             for name, r in result["roles"].items()])
    model = result["model"]
    head = (f"{result['world_size']} ranks on {result['nodes']} node(s) of {result['ranks_per_node']}; "
            f"model {model['name']} ({model['params'] / 1e9:.2f}B parameters); ZeRO-{result['zero_stage']}, "
            f"Adam offload {'on' if result['adam_offload'] else 'off'}; {result['gpu_memory_gb']:g} GB per GPU")
    verdict = "the plan fits" if result["fits"] else "the plan does NOT fit: see the rows marked NO"
    return (f"{head}\n\n{table}\n\nper-role GB per rank (GB/rank adds colocated roles and "
            f"{result['overhead_gb']:g} GB overhead):\n{breakdown}\n\n{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message; keep `main` returning an exit code
        return int(exc.code or 0)
    for flag, value in (("--rollout-seqs", args.rollout_seqs), ("--seq-len", args.seq_len),
                        ("--micro-batch-size", args.micro_batch_size)):
        if value < 1:
            print(f"hpc-rlhf plan: {flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    try:
        result = compute(args)
    except PlacementError as exc:
        print(f"hpc-rlhf plan: --placement: {exc}", file=sys.stderr)
        return 2
    except ModelShapeError as exc:
        print(f"hpc-rlhf plan: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # memory model arguments, e.g. Adam offload without ZeRO
        print(f"hpc-rlhf plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_report(result))
    return 0
