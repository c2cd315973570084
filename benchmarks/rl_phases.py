"""Where a PPO step's time goes, for the disjoint 6-rank tiny layout (actor, critic, ref, reward, 2 rollout).

Runs `hpc-rlhf ppo --config examples/tiny/ppo.yaml` under torchrun (6 local ranks, one thread each) and reads
the per-step phase times the recipe logs in metrics.jsonl: time_generate, time_score, time_train, time_sync,
time_step (as seen by rank 0, the actor's leader). The models are RANDOM-INIT folders (the shipped llama-tiny
config, 1M parameters; the critic and reward model are the same body with a new scalar head): the timing does
not depend on what the weights have learnt, so no SFT or RM run is needed first.

Data movement: every experience call the recipe makes (`messages.share_responses`: the engines' responses and
sampling log-probs; `messages.share_known`: a step's scores; the gathers inside a scoring role,
`exchange.gather_ragged`; each message along its route, by broadcast over the route's group or point to point)
is timed on every rank, with
no synchronisation added: each rank reads the machine's monotonic clock (CLOCK_MONOTONIC, one clock for all
processes of a machine) when it enters and leaves the call. Every rank makes the same calls in the same order
(ranks outside a route return at once), so the k-th call of a kind is the same exchange on every rank. For a
rank, the call's partners are the ranks of the routes it is on; what it spends before the last partner has
entered is waiting for slower roles ("wait"), what it spends after that is moving the data ("move"). The share
of the step spent moving data is (move + time_sync) / time_step on rank 0; time_sync covers gathering the
actor's weights and streaming them to both rollout engines. The instrumentation's own cost is two clock reads
per call on each rank; an older version separated wait from move with a barrier before every call, which cost
about as much as the messages it measured.

    .venv/bin/python benchmarks/rl_phases.py
    .venv/bin/python benchmarks/rl_phases.py --steps 30 --placement actor=2,critic=1,ref=1,reward=1,rollout=1
    .venv/bin/python benchmarks/rl_phases.py --config examples/tiny/grpo.yaml --placement actor=1,ref=1,rollout=2 \
        --set rl.max_staleness=1
    .venv/bin/python benchmarks/rl_phases.py --task long-tailed --set rl.padding_free=false \
        --alternate rl.padding_free=true
    .venv/bin/python benchmarks/rl_phases.py --smoke       # does it run (the suite's smoke run): no figures to keep
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

PHASES = ("time_generate", "time_score", "time_train", "time_sync")
EXCHANGE_FILE = "exchange_rank{rank}.json"
SMOKE = ["--steps", "2", "--warmup", "1", "--rows", "64", "--placement", "actor+critic+ref+reward=1,rollout=1"]


# ------------------------------------------------------------------------------------------------ worker
def worker(out_dir: Path, ppo_args: list[str], settle: bool) -> int:
    """One rank under torchrun: clock the exchange calls, run the PPO mode, write this rank's calls."""
    import torch.distributed as dist

    from hpc_rlhf.dist import exchange
    from hpc_rlhf.rl import messages

    calls: list[list] = []  # [kind, step, partners, arrived, entered, left]
    step = [0]
    settle_groups: dict[tuple[int, ...], object] = {}

    def clock() -> float:
        return time.clock_gettime(time.CLOCK_MONOTONIC)

    def settled(everyone: tuple[int, ...]) -> None:
        """--settle: a barrier of every rank the call can involve (the same set on every rank)."""
        if everyone not in settle_groups:  # every rank makes the same calls in the same order: safe to create here
            settle_groups[everyone] = dist.new_group(list(everyone))
        if dist.get_rank() in everyone:
            dist.barrier(group=settle_groups[everyone])

    def timed(fn, kind, partners_of, everyone_of):
        def call(*args, **kwargs):
            arrived = clock()
            if settle:
                settled(tuple(sorted(everyone_of(*args, **kwargs))))
            entered = clock()
            result = fn(*args, **kwargs)
            name = kind(*args, **kwargs) if callable(kind) else kind
            calls.append([name, step[0], sorted(partners_of(*args, **kwargs)), arrived, entered, clock()])
            return result
        return call

    def on_routes(routes, keys, me=None) -> set[int]:
        return {r for key in keys for r in routes[key].ranks if me is None or me in routes[key].ranks}

    def batch_ranks(routes, kind) -> set[int]:
        return set(routes[kind].ranks) | set(routes["engines"].ranks)

    def response_partners(args) -> set[int]:
        """Every engine's first rank and every consumer of the batch: each engine's share reaches each consumer
        (directly on gloo, or through the hub), so a rank on either route waits for all of them. `args`:
        share_responses(routes, mine, kind, counts, max_len, ...), `kind` the batch's route."""
        everyone = batch_ranks(args[0], args[2])
        return everyone if dist.get_rank() in everyone else set()

    messages.share_responses = timed(
        messages.share_responses, lambda *a, **kw: f"share_responses {a[2]}",
        lambda *a, **kw: response_partners(a),
        lambda *a, **kw: batch_ranks(a[0], a[2]))
    messages.share_known = timed(messages.share_known, "share_known",
                                 lambda routes, sent, **kw: on_routes(routes, sent, dist.get_rank()),
                                 lambda routes, sent, **kw: on_routes(routes, sent))
    group_ranks = lambda seqs, dst, group=None, **kw: exchange.group_ranks(group)  # noqa: E731
    exchange.gather_ragged = timed(exchange.gather_ragged, lambda *a, **kw: f"gather {kw.get('tag')}", group_ranks,
                                   group_ranks)
    benchlib.on_each_rl_step(lambda: step.__setitem__(0, step[0] + 1))

    def write() -> None:
        (out_dir / EXCHANGE_FILE.format(rank=dist.get_rank())).write_text(json.dumps({"calls": calls}))

    return benchlib.run_ppo_then(write, ppo_args)


def wait_and_move(ranks: list[dict], steps: int) -> list[list[dict]]:
    """Per rank and step: seconds waiting for the call's partners to arrive and seconds moving data after that,
    and the number of calls this rank took part in (see the module docstring)."""
    entered: dict[tuple[int, str, int], float] = {}  # (rank, kind, k-th call of that kind) -> entry time
    for rank, figures in enumerate(ranks):
        seen: dict[str, int] = {}
        for kind, _, _, _, t_in, _ in figures["calls"]:
            entered[(rank, kind, seen.get(kind, 0))] = t_in
            seen[kind] = seen.get(kind, 0) + 1
    out = [[{"wait": 0.0, "move": 0.0, "calls": 0, "by_kind": {}} for _ in range(steps)] for _ in ranks]
    for rank, figures in enumerate(ranks):
        seen = {}
        for kind, step, partners, t_arrived, t_in, t_out in figures["calls"]:
            k = seen.get(kind, 0)
            seen[kind] = k + 1
            if len(partners) < 2 or step >= steps:
                continue  # took no part, or nothing travelled; or after the last step
            last = max(entered[(p, kind, k)] for p in partners)
            cell = out[rank][step]
            cell["wait"] += max(0.0, min(last, t_out) - t_arrived)
            moved = max(0.0, t_out - max(last, t_in))
            cell["move"] += moved
            cell["calls"] += 1
            cell["by_kind"][kind] = cell["by_kind"].get(kind, 0.0) + moved
    return out


# ------------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]), argv[3:], settle=argv[2] == "settle")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="RL steps in the run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--placement", default="actor=1,critic=1,ref=1,reward=1,rollout=2")
    parser.add_argument("--config", default="examples/tiny/ppo.yaml",
                        help="the tiny RL config (examples/tiny/grpo.yaml: critic-free, rule reward)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the run, e.g. rl.max_staleness=1 (repeatable)")
    parser.add_argument("--rows", type=int, default=1024, help="prompts loaded (set-up cost only)")
    parser.add_argument("--settle", action="store_true",
                        help="a barrier of the call's ranks before every exchange call (the older instrumentation)")
    parser.add_argument("--task", choices=("tiny", "long-tailed"), default="tiny",
                        help="the prompts: the tiny addition task, or the length-varied one (benchlib."
                             "write_long_tailed_prompts: long-tailed prompt and response lengths)")
    parser.add_argument("--alternate", metavar="KEY=VALUE", default=None,
                        help="runs without and with this setting, taking turns (--rounds pairs, the order rotated "
                             "each round), and a table of the two side by side, e.g. rl.padding_free=true")
    parser.add_argument("--rounds", type=int, default=2, help="--alternate: pairs of runs")
    parser.add_argument("--smoke", action="store_true",
                        help=f"that it runs, not a measurement: {' '.join(SMOKE)}, every rank forked from this "
                             "process (benchlib.run_ranks)")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*argv, *SMOKE])
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    benchlib.ensure_assets()
    from hpc_rlhf.dist.placement import world_size_of

    nproc = world_size_of(args.placement)
    benchlib.header(f"RL step phases, {args.config}, placement {args.placement} {' '.join(args.set)}, task "
                    f"{args.task} ({nproc} ranks, 1 thread each)")
    if args.alternate:
        return alternate(args, nproc)
    metrics, ranks, wall = run_once(args, nproc, [])
    report(args, metrics, ranks, wall)
    return 0


def run_once(args, nproc: int, extra: list[str]) -> tuple[list[dict], list[dict], float]:
    """One run of the recipe on random-init models: its metrics rows, every rank's exchange calls, its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        actor, value = benchlib.random_actor_and_value(tmp)
        out = tmp / "ppo"
        out.mkdir()
        roles = {entry.split("=")[0] for entry in args.placement.replace("+", ",").split(",")}
        value_roles = ([f"critic.path={value}"] if "critic" in roles else []) + \
            ([f"reward.models=[{value}]"] if "reward" in roles else [])
        task = ([f"data.train_files=[{benchlib.DATA / 'prompts_train.jsonl'}]"] if args.task == "tiny" else
                benchlib.long_tailed_settings(benchlib.write_long_tailed_prompts(tmp / "prompts.jsonl", args.rows)))
        ppo_args = ["--config", str(benchlib.REPO / args.config), f"output_dir={out}",
                    f"placement={args.placement}", f"actor.path={actor}", *value_roles,
                    f"train.max_steps={args.steps}", f"critic_train.max_steps={args.steps}", *task,
                    f"data.max_train_rows={args.rows}",
                    "data.eval_files=[]", "log.every_steps=1", "log.eval_every_steps=0", "log.tensorboard=false",
                    "log.progress=false", "checkpoint.resume=false", *args.set, *extra]
        started = time.perf_counter()
        benchlib.run_ranks(nproc, Path(__file__).resolve(),
                           ["--worker", str(out), "settle" if args.settle else "clock", *ppo_args],
                           "local" if args.smoke else "torchrun", main, what=f"{nproc}-rank PPO", timeout=1200)
        wall = time.perf_counter() - started
        metrics = sorted((r for r in benchlib.read_jsonl(out / "metrics.jsonl") if "time_step" in r),
                         key=lambda r: r["step"])
        ranks = [json.loads((out / EXCHANGE_FILE.format(rank=r)).read_text()) for r in range(nproc)]
    return metrics, ranks, wall


def alternate(args, nproc: int) -> int:
    """--alternate: the runs without and with a setting take turns; per phase the median over every steady step of
    every run of each side, and the ratio of the two."""
    sides = {"without": [], f"with {args.alternate}": [args.alternate]}
    steps = {name: [] for name in sides}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for name in order:
            metrics, _, _ = run_once(args, nproc, sides[name])
            steps[name] += metrics[args.warmup:]
    keys = (*PHASES, "time_step", "pad_share", "response_length")
    med = {name: {key: benchlib.median(r.get(key, float("nan")) for r in rows) for key in keys}
           for name, rows in steps.items()}
    without, with_ = list(sides)
    rows = [[key.removeprefix("time_"), med[without][key], med[with_][key],
             benchlib.ratio(med[with_][key], med[without][key])] for key in keys]
    print(f"   {args.rounds} rounds, {len(steps[without])} steady steps a side; machine after: "
          f"{benchlib.machine_state()}\n")
    print(benchlib.table(["figure (rank 0, median of steps)", without, with_, "with / without"], rows))
    return 0


def report(args, metrics: list[dict], ranks: list[dict], wall: float) -> None:
    timed = metrics[args.warmup:]
    steady = range(args.warmup, len(metrics))
    med = {key: benchlib.median(r[key] for r in timed)
           for key in (*PHASES, "time_step", "samples_per_s", "response_length")}
    per_step = wait_and_move(ranks, len(metrics))
    move0 = benchlib.median(per_step[0][i]["move"] for i in steady)
    wait0 = benchlib.median(per_step[0][i]["wait"] for i in steady)
    move_max = benchlib.median(max(rk[i]["move"] for rk in per_step) for i in steady)
    calls = per_step[0][args.warmup]["calls"]
    step = med["time_step"]
    print("   models: random init (llama-tiny actor/ref, value-model critic/reward) - timing only, not learning")
    print(f"   {len(metrics)} RL steps ({len(timed)} after warmup), the config's prompts and samples, "
          f"{med['response_length']:.2f} new tokens per response (median of steps); whole run {wall:.0f} s wall "
          f"(start-up included)")
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows = [[name.removeprefix("time_"), med[name], benchlib.ratio(med[name], step)] for name in PHASES]
    rows.append(["step (total)", step, benchlib.ratio(sum(med[n] for n in PHASES), step)])
    print(benchlib.table(["phase (rank 0)", "seconds (median)", "share of step"], rows))
    print()
    moving = move0 + med["time_sync"]
    rows = [["experience exchange, transfer (rank 0)", move0, benchlib.ratio(move0, step)],
            ["experience exchange, transfer (slowest rank)", move_max, benchlib.ratio(move_max, step)],
            ["weight sync (time_sync)", med["time_sync"], benchlib.ratio(med["time_sync"], step)],
            ["moving data: exchange + sync (rank 0)", moving, benchlib.ratio(moving, step)],
            ["waiting for other roles at exchanges (rank 0)", wait0, benchlib.ratio(wait0, step)]]
    print(benchlib.table(["data movement per step", "seconds (median)", "share of step"], rows))
    kinds = sorted({kind for i in steady for kind in per_step[0][i]["by_kind"]})
    rows = [[kind, benchlib.median(per_step[0][i]["by_kind"].get(kind, 0.0) for i in steady)] for kind in kinds]
    print()
    print(benchlib.table(["moving data on rank 0, by call", "seconds (median per step)"], rows))
    print(f"\n   {calls} exchange calls per step on rank 0, each timed by two clock reads on every rank (no added "
          f"synchronisation); {med['samples_per_s']:.1f} samples/s")


if __name__ == "__main__":
    sys.exit(main())
