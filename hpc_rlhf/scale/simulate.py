"""`hpc-rlhf simulate`: the real set-up of an RL job of W ranks, run in one process for every rank on a
process-group backend that moves no data (hpc_rlhf.dist.fake_world), to see what grows with the job before any
GPU is booked.

    hpc-rlhf simulate --world-size 1024 --gpus-per-node 8 --model 70b \\
        --placement actor=256,critic=128,ref=64,reward=64,rollout=512,rollout_tp=1 [--json]

For each rank in turn it becomes that rank of a fake world and runs the project's own code:
`groups.initialize(plan, Routes(plan).message_groups())` (recording the order of `new_group` calls, which must be
the same on every rank: checked), DeepSpeed's model-parallel group on the trained ranks
(engines.deepspeed_compat.singleton_group), then one RL step's messages with the real message functions:
the engines' responses (`messages.share_generated`), each scoring role's gather to its leader
(`scoring.score_on_shard` over placeholder results of the right sizes), the scores to the trained roles
(`messages.share_known` of `messages.score_messages`), the critic's figures, an evaluation's responses, and on the
actor's leader the weight sync's bucket stream (`weight_sync.send_weights` over the model built on the meta device
from its config.json, or from the preset's: every bucket of the real schedule, no bytes), twice, the second one
counted (from the second sync on, the layout is reused). The rollout ranks' side of the weight sync is the leader's
broadcasts (a broadcast delivers every message to every rank of its group); receive_weights itself does not run.

Per rank it reports the groups it belongs to and their sizes, its point-to-point peers, its communicators (see
hpc_rlhf.scale.communicators: groups, peers, and DeepSpeed's model-parallel group under ZeRO-0), the messages and
bytes it sends and receives in each phase and the largest message, and the planner's memory figure for it; per
node, the planner's host memory. It also checks that the planner's count of communicators (computed without torch)
is what the real set-up holds, on every rank. A node short of host memory (`--host-memory-gb`) is refused as
`hpc-rlhf plan` refuses it, after the report: one line naming the setting, exit code 2. GPU memory is reported,
not refused (hpc_rlhf.dist.allocation.host_refusal says why).

What it does not run: the models (no forward pass, no data; message sizes come from the batch settings, the
longest possible responses), vLLM's own processes and their tensor-parallel communicators, and the training
engines' collectives inside a role group (they stay in that group: engines.deepspeed_compat).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from hpc_rlhf.dist import exchange, fake_world, groups, plan_cli, weight_sync
from hpc_rlhf.dist.allocation import host_refusal, public
from hpc_rlhf.dist.placement import Plan, format_rows
from hpc_rlhf.engines import deepspeed_compat
from hpc_rlhf.engines.rollout.base import hf_named_tensors
from hpc_rlhf.models.lora import merged_tensors
from hpc_rlhf.rl import messages, routes, scoring
from hpc_rlhf.rl.batches import Generated, shard_bounds
from hpc_rlhf.scale import communicators
from hpc_rlhf.scale import plan as plan_command
from hpc_rlhf.scale.job import JobInputError, check_job, refuse

PROG = "hpc-rlhf simulate"
STEP_PHASES = ("exchange", "scoring", "weight_sync")  # one RL step; "eval" is counted apart


class SimulationError(RuntimeError):
    """The real set-up broke a rule of the world (ranks that create groups in different orders)."""


@dataclasses.dataclass(frozen=True)
class Batch:
    prompts: int
    samples: int
    response_len: int
    micro_batch_size: int
    eval_rows: int = 64
    bucket_mb: float = 256.0
    rule_rewards: bool | None = None  # None: with no reward model only


def build_parser() -> argparse.ArgumentParser:
    """`hpc-rlhf plan`'s flags (the same names and defaults for the job, the batch and the hardware) and this
    command's own."""
    parser = argparse.ArgumentParser(prog=PROG, parents=[plan_command.build_parser()], conflict_handler="resolve",
                                     description="Run the real set-up of an RL job of every rank in one process, "
                                                 "on a backend that moves no data, and report per rank its "
                                                 "communicators, messages and memory (with --hardware, the step "
                                                 "time too).")
    parser.add_argument("--eval-rows", type=int, default=Batch.eval_rows, help="prompts of an evaluation")
    parser.add_argument("--rule-rewards", action="store_true", default=None,
                        help="rule rewards besides the reward models (default: only without a reward model)")
    return parser


# ------------------------------------------------------------------------------------------------- the model
def meta_model(model: str, shape) -> torch.nn.Module:
    """The actor as transformers builds it from its config.json (a preset's: ModelShape.to_config_json), on the
    meta device: every parameter with its shape and dtype, no memory."""
    from pathlib import Path

    import transformers  # heavy: only the simulation needs it

    path = Path(model)
    if path.exists():
        config = transformers.AutoConfig.from_pretrained(path if path.is_dir() else path.parent)
    else:
        fields = shape.to_config_json()
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


# ------------------------------------------------------------------------------------------------- one rank
@dataclasses.dataclass
class RankReport:
    rank: int
    roles: list[str]
    groups: list[tuple[str, int]]  # (description, size) of every group it belongs to, WORLD aside
    peers: list[int]  # point to point, in one RL step or an evaluation
    communicators: list[str]
    phases: dict[str, dict[str, int]]  # phase -> messages, sent, received (bytes)
    largest_message_bytes: int
    memory_gb: float

    def to_dict(self) -> dict:
        return {"rank": self.rank, "roles": self.roles, "groups": [list(g) for g in self.groups], "peers": self.peers,
                "communicators": len(self.communicators), "communicator_names": self.communicators,
                "phases": self.phases,
                "largest_message_bytes": self.largest_message_bytes, "memory_gb": self.memory_gb}


def _one_rank(rank: int, plan: Plan, batch: Batch, stream, recorder: fake_world.Recorder) -> list[str]:
    """Rank `rank`'s set-up and one RL step's messages, recorded; its held groups (descriptions)."""
    table = routes.Routes(plan)
    groups.initialize(plan, table.message_groups())
    held = [desc for desc, _ in groups.held_groups()]
    roles = plan.roles_of_rank(rank)
    if any(plan.role(r).kind in communicators.TRAINED_KINDS for r in roles):
        deepspeed_compat.singleton_group()
    leaders = routes.engine_leaders(plan)
    samples = batch.prompts * batch.samples

    def responses(count: int, length: int) -> list[torch.Tensor]:  # the longest possible: the most bytes
        return [torch.zeros(length, dtype=torch.long) for _ in range(count)]

    def share(kind: str, prompts: int, n: int, length: int, with_logprobs: bool) -> None:
        mine = None
        if rank in leaders:
            start, end = shard_bounds(prompts, len(leaders), leaders.index(rank))
            mine = Generated(responses(n * (end - start), length))
            mine.logprobs = [torch.zeros(length) for _ in mine.responses] if with_logprobs else None
        messages.share_generated(table, mine, kind, prompts, n, length, with_logprobs=with_logprobs)

    with recorder.phase("exchange"):
        if leaders:
            share("responses", batch.prompts, batch.samples, batch.response_len, True)
    with recorder.phase("scoring"):
        local = {}
        for role in roles:
            kind = plan.role(role).kind
            if kind == "rollout":
                continue
            per_sample = 1 if kind == "reward" else batch.response_len
            gathered = scoring.score_on_shard(role, samples, batch.micro_batch_size, lambda lo, hi: hi - lo,
                                              lambda count, k=per_sample: [torch.zeros(k)] * count)
            # The fake gather hands the leader copies of its own shard (fake_world): what it sends on has the
            # batch's sizes, as the real gather's would.
            local[role] = [torch.zeros(per_sample)] * samples if gathered is not None else None
    with recorder.phase("exchange"):
        scoring_roles = [name for name, role in plan.roles.items() if role.kind != "rollout"]
        with_rules = batch.rule_rewards if batch.rule_rewards is not None else \
            not any(role.kind == "reward" for role in plan.roles.values())
        rules = [torch.zeros(samples)] if rank == routes.rule_reward_rank(plan) else None
        knows = rank in table["responses"].takers  # the ranks that hold the batch know its lengths
        messages.share_known(table, messages.score_messages(local, scoring_roles, rules, with_rules,
                                                     [batch.response_len] * samples if knows else None))
        messages.critic_figures_to_logger(table, {k: 0.0 for k in messages.CRITIC_FIGURES})
    if not plan.is_hybrid and rank == plan.role("actor").leader:
        for phase in ("weight_sync_first", "weight_sync"):  # the second sync reuses the first one's layout
            with recorder.phase(phase):
                weight_sync.send_weights(iter(stream), rank, groups.weight_sync_group(), bucket_mb=batch.bucket_mb,
                                         reuse_layout=True, device=torch.device("meta"))
        weight_sync.release_buffers()
    with recorder.phase("eval"):
        if batch.eval_rows:
            share("eval", batch.eval_rows, 1, batch.response_len, False)
    groups.destroy()
    deepspeed_compat.forget_singleton_group()
    return held


def _summary(calls: list[fake_world.Call], phases) -> tuple[dict[str, dict[str, int]], int]:
    out = {phase: {"messages": 0, "sent": 0, "received": 0} for phase in phases}
    largest = 0
    for call in calls:
        if call.phase in out and (call.sent or call.received):
            cell = out[call.phase]
            cell["messages"] += 1
            cell["sent"] += call.sent
            cell["received"] += call.received
            largest = max(largest, call.nbytes)
    return out, largest


P2P_OPS = ("send", "recv", "isend", "irecv")


def simulate(args: argparse.Namespace) -> dict:
    """The report `--json` prints (see the module docstring) and, under `_host_refusal`, the line a node short of
    host memory is refused with (None when every node fits). Raises JobInputError for bad input."""
    if args.eval_rows < 0:
        raise JobInputError("--eval-rows", f"must be at least 0, got {args.eval_rows}")
    started = time.perf_counter()
    args.step_time = args.hardware is not None
    planned = plan_command.compute(args)  # the same checks and the same memory figures as `hpc-rlhf plan`
    job = check_job(args.world_size, args.gpus_per_node, args.placement, args.model)
    plan = job.plan
    if not plan.has("rollout"):
        raise JobInputError("--placement", "has no rollout role; the simulation runs an RL job's set-up (give "
                                           "rollout=N or rollout@actor)")
    batch = Batch(args.prompts, args.samples, args.response_len, args.micro_batch_size, args.eval_rows,
                  args.bucket_mb, args.rule_rewards)
    counted = communicators.communicators_of(plan, args.zero_stage)
    stream = []
    if plan.has("rollout") and not plan.is_hybrid:
        stream = list(hf_named_tensors(merged_tensors(meta_model(args.model, job.shape))))

    recorder = fake_world.Recorder()
    order: list[tuple] | None = None
    reports: list[RankReport] = []
    sync_calls: list[fake_world.Call] = []
    with recorder.recording():
        for rank in range(plan.world_size):
            recorder.reset()
            with fake_world.as_rank(rank, plan.world_size):
                held = _one_rank(rank, plan, batch, stream, recorder)
            calls = [(g.ranks, g.desc) for g in recorder.new_groups if not g.local]
            if order is None:
                order = calls
            elif calls != order:
                first = next(i for i, (a, b) in enumerate(zip(calls + [None] * len(order), order)) if a != b)
                raise SimulationError(f"rank {rank} creates its groups in another order than rank 0 (call {first}: "
                                      f"{calls[first:first + 1]} vs {order[first:first + 1]}): a real job would hang")
            if rank == plan.role("actor").leader:
                sync_calls = [c for c in recorder.calls if c.phase == "weight_sync"]
            local = [g for g in recorder.new_groups if g.local]
            peers = sorted({c.peer for c in recorder.calls if c.op in P2P_OPS and c.phase in (*STEP_PHASES, "eval")})
            mine = held + [f"p2p/{p}" for p in peers]
            if local and args.zero_stage == 0:
                mine.append(communicators.SINGLETON)
            phases, largest = _summary(recorder.calls, (*STEP_PHASES, "eval"))
            sizes = {desc: len(ranks) for ranks, desc in calls}
            group_list = [(desc, sizes[desc]) for desc in held] + [("deepspeed/model_parallel", 1) for _ in local]
            reports.append(RankReport(rank, plan.roles_of_rank(rank), group_list, peers, mine, phases, largest,
                                      communicators.rank_memory_gb(planned, plan, rank, len(mine))))
    _add_weight_sync_receivers(reports, plan, sync_calls)
    disagree = [r.rank for r in reports if sorted(r.communicators) != sorted(counted[r.rank])]
    return {
        "world_size": plan.world_size, "ranks_per_node": plan.ranks_per_node, "placement": str(args.placement),
        "model": {"name": job.shape.name, "params": job.shape.num_params},
        "batch": dataclasses.asdict(batch), "zero_stage": args.zero_stage,
        "max_groups_per_rank": max(len(r.communicators) for r in reports),
        "new_group_calls": len(order or []), "new_group_order": [desc for _, desc in order or []],
        "planner_agrees": not disagree, "planner_disagrees_on": disagree[:20],
        "nccl_communicator_gb": communicators.NCCL_COMMUNICATOR_GB,
        "max_memory_gb": max(r.memory_gb for r in reports),
        "host": planned["host"], "_host_refusal": host_refusal(planned),
        "seconds": round(time.perf_counter() - started, 2),
        **({"step_time": planned["step_time"]} if "step_time" in planned else {}),
        "ranks": [r.to_dict() for r in reports],
    }


def _add_weight_sync_receivers(reports: list[RankReport], plan: Plan, sync_calls: list[fake_world.Call]) -> None:
    """Every rollout rank receives each broadcast of the leader's steady-state sync (see the module docstring)."""
    if not sync_calls:
        return
    received = sum(c.nbytes for c in sync_calls)
    largest = max(c.nbytes for c in sync_calls)
    for rank in plan.role("rollout").ranks:
        cell = reports[rank].phases["weight_sync"]
        cell["messages"] += len(sync_calls)
        cell["received"] += received
        reports[rank].largest_message_bytes = max(reports[rank].largest_message_bytes, largest)


# ------------------------------------------------------------------------------------------------- printing
def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def format_report(result: dict) -> str:
    by_role: dict[str, list[dict]] = {}
    for rank in result["ranks"]:
        by_role.setdefault("+".join(rank["roles"]) or "-", []).append(rank)
    rows = []
    for name, ranks in by_role.items():
        def most(key, phase=None, field=None):
            return max(r[key][phase][field] if phase else r[key] for r in ranks)
        rows.append((name, len(ranks), most("communicators"), max(len(r["groups"]) for r in ranks),
                     max(len(r["peers"]) for r in ranks),
                     *(f"{_mb(most('phases', p, 'sent'))}/{_mb(most('phases', p, 'received'))}" for p in STEP_PHASES),
                     _mb(most("largest_message_bytes")), f"{most('memory_gb'):.1f}"))
    table = format_rows(("ranks holding", "ranks", "communicators", "groups", "peers",
                         *(f"{p} MB out/in" for p in STEP_PHASES), "largest MB", "GB/rank"), rows)
    worst = max(result["ranks"], key=lambda r: r["communicators"])
    sizes = dict(worst["groups"])
    held = ", ".join(f"{name} ({sizes[name]})" if name in sizes else name for name in worst["communicator_names"])
    model = result["model"]
    return (f"{result['world_size']} ranks, model {model['name']} ({model['params'] / 1e9:.2f}B), "
            f"{result['batch']['prompts']} prompts x {result['batch']['samples']} samples of up to "
            f"{result['batch']['response_len']} tokens; simulated in {result['seconds']} s\n\n{table}\n\n"
            f"most communicators on one rank: {result['max_groups_per_rank']} (rank {worst['rank']}: {held})\n"
            f"new_group calls on every rank, in the same order: {result['new_group_calls']}\n"
            f"the planner's count agrees on every rank: {'yes' if result['planner_agrees'] else 'NO'}\n"
            f"(MB out/in: the most a rank of the row sends and receives in one RL step's phase; communicators: groups, "
            f"point-to-point peers and, under ZeRO-0, DeepSpeed's model-parallel group; "
            f"{result['nccl_communicator_gb']} GB each in GB/rank)\n\n{plan_cli.host_line(result['host'])}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        result = simulate(args)
    except JobInputError as exc:
        return refuse(PROG, exc)
    except exchange.ExchangeError as exc:  # a message the set-up could not build: a bug, said plainly
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(public(result)) if args.json else format_report(result)
    if "step_time" in result and not args.json:
        text += "\n\n" + plan_command.format_step_time(result["step_time"])
    print(text)
    if result["_host_refusal"] is not None:  # as `hpc-rlhf plan` refuses a plan that does not fit: after showing it
        print(f"{PROG}: {result['_host_refusal']}", file=sys.stderr)
        return 2
    return 0
