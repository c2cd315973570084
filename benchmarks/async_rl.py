"""Asynchronous RL: PPO samples/s with rl.max_staleness K = 0, 1, 2 in the 6-rank disjoint layout, each role's
idle share of the step, and the speedup the measured phase times predict where every role has devices of its own.

Runs `hpc-rlhf ppo --config examples/tiny/ppo.yaml` under torchrun (actor, critic, ref, reward, two rollout
engines: 6 local ranks, one thread each) with RANDOM-INIT models (the shipped llama-tiny config, 1M parameters;
critic and reward model are the same body with a new scalar head): timing does not depend on what the weights
have learnt. In every round each K runs once, back to back, in an order rotated from round to round. A run's
rate is samples per step / its median step period after the warmup steps (the wall clock between consecutive
metrics.jsonl rows: with K >= 1 that is the pipeline's period); ratios are medians of the per-round ratios
against K = 0 of the same round, which saw about the same load.

Idle share: on every rank the calls that wait for other ranks are timed (the experience messages
`messages.share_responses` and `share_known`, the gathers inside a scoring role `exchange.gather_ragged`, the
weight sync `weight_sync.send_weights`/`receive_weights`, the step's one agreement `any_rank`, the critic's
figures, the stop-signal check); a rank's idle share of a step is the time inside them over the step's time on that
rank, its work the rest. Those calls include their transfers, which are small here (benchmarks/rl_phases.py
measures them apart). The instrumentation costs two clock reads per call: the count of calls and their measured
cost are printed.

Prediction for a layout where every role has its own devices, from the K = 0 runs (where the phases mostly run
one after the other): per step, G = the rollout ranks' work (generation, the longest engine), ST = the longest
work of the other ranks (scoring, advantages, training), C = the rest of the step period (transfers, latencies,
scheduling: the period minus the wall-clock G and ST). Synchronous: T0 = G + ST + C; with K >= 1 the generation
of the next batch overlaps this one's scoring and training: T1 = max(G, ST) + C; predicted speedup T0 / T1.
G and ST are taken two ways: as wall-clock work, inflated here where ranks share the 2 cores (the four scoring
ranks score at the same time), and as the CPU time of that work (one thread per rank: what it would take on a
core of its own). K = 2 is the same as K = 1 in this model: more staleness only absorbs steps whose generation
takes longer than usual.

    .venv/bin/python benchmarks/async_rl.py                     # 1 round of K = 0, 1, 2, 14 steps each
    .venv/bin/python benchmarks/async_rl.py --rounds 3 --steps 20
    .venv/bin/python benchmarks/async_rl.py --new-tokens 48     # generation a larger share of the step
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

PLACEMENT = "actor=1,critic=1,ref=1,reward=1,rollout=2"
RANK_FILE = "async_rank{rank}.json"
SAMPLES_PER_STEP = 64  # examples/tiny/ppo.yaml: 16 prompts x 4 samples
SMOKE = ["--steps", "3", "--warmup", "1", "--ks", "0", "1", "--rows", "64", "--new-tokens", "2"]


# ------------------------------------------------------------------------------------------------ worker
def worker(out_dir: Path, ppo_args: list[str]) -> int:
    """One rank under torchrun: time the waiting calls, run the PPO mode, write this rank's figures."""
    import torch.distributed as dist

    from hpc_rlhf.dist import agree, exchange, groups, weight_sync
    from hpc_rlhf.rl import messages

    waiting = {"s": 0.0, "cpu": 0.0, "calls": 0}
    steps: list[dict] = []

    def timed(fn):
        def call(*args, **kwargs):
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                waiting["s"] += time.perf_counter() - start
                waiting["cpu"] += time.process_time() - start_cpu
                waiting["calls"] += 1
        return call

    # every module looks these up when it calls them, so wrapping the module attribute reaches every caller
    messages.share_responses = timed(messages.share_responses)
    messages.share_known = timed(messages.share_known)
    exchange.gather_ragged = timed(exchange.gather_ragged)
    weight_sync.send_weights = timed(weight_sync.send_weights)
    weight_sync.receive_weights = timed(weight_sync.receive_weights)
    agree.any_rank = timed(agree.any_rank)  # the step's one agreement (skipped step, stop signal)
    messages.critic_figures_to_logger = timed(messages.critic_figures_to_logger)
    benchlib.on_each_rl_step(lambda: steps.append({"end": time.perf_counter(), "end_cpu": time.process_time(),
                                                   **waiting}))

    def write() -> None:
        start = time.perf_counter()
        probe = timed(lambda: None)
        for _ in range(10000):
            probe()
        call_cost = (time.perf_counter() - start) / 10000  # one timed call around nothing
        (out_dir / RANK_FILE.format(rank=dist.get_rank())).write_text(json.dumps(
            {"roles": groups.my_roles(), "steps": steps, "call_cost_s": call_cost}))

    return benchlib.run_ppo_then(write, ppo_args)


# ------------------------------------------------------------------------------------------------ driver
def run_once(tmp: Path, actor: Path, value: Path, k: int, args, name: str) -> dict:
    out = tmp / name
    out.mkdir()
    ppo_args = ["--config", str(benchlib.REPO / "examples/tiny/ppo.yaml"), f"output_dir={out}",
                f"placement={PLACEMENT}", f"actor.path={actor}", f"critic.path={value}", f"reward.models=[{value}]",
                f"rl.max_staleness={k}", f"train.max_steps={args.steps}", f"critic_train.max_steps={args.steps}",
                f"rollout.max_new_tokens={args.new_tokens}",
                f"data.train_files=[{benchlib.DATA / 'prompts_train.jsonl'}]", f"data.max_train_rows={args.rows}",
                "data.eval_files=[]", "log.every_steps=1", "log.eval_every_steps=0", "log.tensorboard=false",
                "log.progress=false", "checkpoint.resume=false"]
    benchlib.run_ranks(6, Path(__file__).resolve(), ["--worker", str(out), *ppo_args],
                       "local" if args.smoke else "torchrun", main, what=f"6-rank PPO, rl.max_staleness={k}",
                       timeout=1800)
    metrics = benchlib.read_jsonl(out / "metrics.jsonl")
    ranks = [json.loads((out / RANK_FILE.format(rank=r)).read_text()) for r in range(6)]
    return {"metrics": metrics, "ranks": ranks}


def per_rank_steps(rank: dict) -> list[dict]:
    """Per RL step on one rank: its duration (end to end), its time in the waiting calls, their count, and the
    CPU time of its work (the process's CPU time outside the waiting calls)."""
    s = rank["steps"]
    return [{"time": s[i]["end"] - s[i - 1]["end"], "wait": s[i]["s"] - s[i - 1]["s"],
             "calls": s[i]["calls"] - s[i - 1]["calls"],
             "work_cpu": (s[i]["end_cpu"] - s[i - 1]["end_cpu"]) - (s[i]["cpu"] - s[i - 1]["cpu"])}
            for i in range(1, len(s))]


def analyse(run: dict, warmup: int) -> dict:
    periods = benchlib.rl_step_times_from_metrics(run["metrics"], warmup)
    period = benchlib.median(periods)
    ranks = [per_rank_steps(r) for r in run["ranks"]]
    steady = range(warmup - 1, len(ranks[0]))  # ranks[r][i] is step i + 2 (the first step has no start stamp)
    idle = {}
    for role in ("actor", "critic", "ref", "reward", "rollout"):
        members = [i for i, r in enumerate(run["ranks"]) if role in r["roles"]]
        idle[role] = benchlib.median(ranks[m][i]["wait"] / ranks[m][i]["time"] for m in members for i in steady)
    rollout = [i for i, r in enumerate(run["ranks"]) if "rollout" in r["roles"]]
    others = [i for i in range(len(ranks)) if i not in rollout]

    def work(m, i):
        return ranks[m][i]["time"] - ranks[m][i]["wait"]

    def cpu(m, i):
        return ranks[m][i]["work_cpu"]

    step = [ranks[0][i]["time"] for i in steady]
    model = {}
    for name, measure in (("wall", work), ("cpu", cpu)):
        g = [max(measure(m, i) for m in rollout) for i in steady]
        st = [max(measure(m, i) for m in others) for i in steady]
        # the rest of the step: transfers, latencies, scheduling (from the wall-clock work, in both models)
        c = [max(0.0, t - max(work(m, i) for m in rollout) - max(work(m, i) for m in others))
             for t, i in zip(step, steady)]
        model[name] = {"G": benchlib.median(g), "ST": benchlib.median(st), "C": benchlib.median(c),
                       "predicted": benchlib.median((a + b + x) / (max(a, b) + x) for a, b, x in zip(g, st, c))}
    calls = benchlib.median(ranks[m][i]["calls"] for m in range(len(ranks)) for i in steady)
    call_cost = benchlib.median(r["call_cost_s"] for r in run["ranks"])
    return {"period": period, "samples_per_s": SAMPLES_PER_STEP / period, "idle": idle, "model": model,
            "calls": calls, "call_cost": call_cost,
            "staleness": [r.get("staleness") for r in run["metrics"] if "staleness" in r]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of one run per K")
    parser.add_argument("--steps", type=int, default=14, help="RL steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (K = 2 fills its pipeline)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="rl.max_staleness values; 0 first")
    parser.add_argument("--rows", type=int, default=1024, help="prompts loaded (set-up cost only)")
    parser.add_argument("--new-tokens", type=int, default=6,
                        help="rollout.max_new_tokens (6 as examples/tiny/ppo.yaml; the random models rarely stop "
                             "early, so this sets the generation's share of the step)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"that it runs, not a measurement: {' '.join(SMOKE)}, every rank forked from this "
                             "process (benchlib.run_ranks)")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*argv, *SMOKE])
    if args.steps <= args.warmup + 1 or args.ks[0] != 0:
        parser.error("--steps must exceed --warmup + 1, and --ks must start with 0 (the baseline)")
    benchlib.ensure_assets()
    benchlib.header(f"PPO with rl.max_staleness in {args.ks}, placement {PLACEMENT} (6 ranks, 1 thread each)")
    results: dict[int, list[dict]] = {k: [] for k in args.ks}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        actor, value = benchlib.random_actor_and_value(tmp)
        for r in range(args.rounds):
            order = args.ks[r % len(args.ks):] + args.ks[:r % len(args.ks)]
            for k in order:
                run = run_once(tmp, actor, value, k, args, f"round{r}-k{k}")
                results[k].append(analyse(run, args.warmup))
    report(args, results, time.perf_counter() - started)
    return 0


def report(args, results: dict[int, list[dict]], wall: float) -> None:
    print(f"   models: random init (llama-tiny actor/ref, value-model critic/reward) - timing only, not learning")
    print(f"   {args.rounds} round(s) x K in {args.ks}, {args.steps} RL steps per run ({args.steps - args.warmup - 1} "
          f"timed), 16 prompts x 4 samples, {args.new_tokens} new tokens; whole benchmark {wall:.0f} s wall "
          "(start-ups included)")
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows = []
    for k in args.ks:
        runs = results[k]
        ratio = benchlib.median(run["samples_per_s"] / base["samples_per_s"] for run, base in zip(runs, results[0]))
        idle = {role: benchlib.median(run["idle"][role] for run in runs) for role in runs[0]["idle"]}
        rows.append([k, benchlib.median(r["period"] for r in runs), benchlib.median(r["samples_per_s"] for r in runs),
                     ratio, *(idle[role] for role in ("actor", "critic", "ref", "reward", "rollout"))])
    print(benchlib.table(["K", "step s (median)", "samples/s", "vs K=0 (paired)", "idle actor", "idle critic",
                          "idle ref", "idle reward", "idle rollout"], rows))
    stale = {k: results[k][0]["staleness"] for k in args.ks}
    print(f"\n   staleness per step (first run of each K): " + "; ".join(f"K={k}: {s}" for k, s in stale.items()))
    base = results[0]
    print("\n   own-devices model from the K=0 runs, medians per step: T0 = G + ST + C (synchronous), "
          "T1 = max(G, ST) + C (K >= 1)")
    rows = []
    for name, what in (("wall", "wall-clock work (cores shared here)"), ("cpu", "CPU time of the work (own core)")):
        g, st, c = (benchlib.median(r["model"][name][key] for r in base) for key in ("G", "ST", "C"))
        rows.append([what, g, st, c, g + st + c, max(g, st) + c,
                     benchlib.median(r["model"][name]["predicted"] for r in base)])
    print(benchlib.table(["G and ST measured as", "G s", "ST s", "C s", "T0 s", "T1 s", "predicted K>=1 / K=0"],
                         rows))
    calls = benchlib.median(r["calls"] for rs in results.values() for r in rs)
    cost = benchlib.median(r["call_cost"] for rs in results.values() for r in rs)
    period = benchlib.median(r["period"] for r in base)
    print(f"\n   instrumentation: {calls:.0f} timed calls per step and rank at {cost * 1e6:.2f} us each "
          f"= {calls * cost * 1e3:.3f} ms per step ({calls * cost / period:.2%} of a K=0 step)")


if __name__ == "__main__":
    sys.exit(main())
