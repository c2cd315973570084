"""Where a PPO step's time goes, for the disjoint 6-rank tiny layout (actor, critic, ref, reward, 2 rollout).

Runs `hpc-rlhf ppo --config examples/tiny/ppo.yaml` under torchrun (6 local ranks, one thread each) and reads
the per-step phase times the recipe logs in metrics.jsonl: time_generate, time_score, time_train, time_sync,
time_step (as seen by rank 0, the actor's leader). The models are RANDOM-INIT folders (the shipped llama-tiny
config, 1M parameters; the critic and reward model are the same body with a new scalar head): the timing does
not depend on what the weights have learnt, so no SFT or RM run is needed first.

Data movement: every experience message the recipe sends (`rl_exchange.share`: to the ranks of its route,
by broadcast over the route's group or point to point; and the gathers inside a scoring role,
`exchange.gather_ragged`) is wrapped, in the ranks of this benchmark only, by a synchronisation of exactly the
ranks taking part (a barrier on the group; a ping-pong of one element between the two ranks of a point-to-point
route) followed by the call itself. The synchronisation absorbs the time a rank waits for slower roles
("wait"), so the call's own time is the transfer ("move"). The share of the step spent moving data is
(move + time_sync) / time_step on rank 0; time_sync covers gathering the actor's weights and streaming them to
both rollout engines. The synchronisations cost time themselves: their count and measured latency are printed,
so their effect on time_step can be judged.

    .venv/bin/python benchmarks/rl_phases.py
    .venv/bin/python benchmarks/rl_phases.py --steps 30 --placement actor=2,critic=1,ref=1,reward=1,rollout=1
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


# ------------------------------------------------------------------------------------------------ worker
def worker(out_dir: Path, ppo_args: list[str]) -> int:
    """One rank under torchrun: instrument the exchanges, run the PPO mode, write this rank's figures."""
    import torch
    import torch.distributed as dist

    from hpc_rlhf.dist import exchange, groups
    from hpc_rlhf.trainers import rl_exchange

    totals = {"wait": 0.0, "move": 0.0, "calls": 0}
    per_step: list[dict] = []

    def in_step(ranks, group) -> None:
        """Return once every rank of `ranks` has arrived (they are the ranks of the call that follows)."""
        if len(ranks) > 2:
            dist.barrier(group=group)
        elif len(ranks) == 2:
            other = ranks[1] if dist.get_rank() == ranks[0] else ranks[0]
            token = torch.zeros(1)
            if dist.get_rank() == ranks[0]:
                dist.send(token, other)
                dist.recv(token, other)
            else:
                dist.recv(token, other)
                dist.send(token, other)

    def timed(fn, ranks_and_group):
        def call(*args, **kwargs):
            ranks, group = ranks_and_group(*args, **kwargs)
            if dist.get_rank() not in ranks or len(ranks) == 1:
                return fn(*args, **kwargs)  # takes no part, or nothing travels
            t0 = time.perf_counter()
            in_step(ranks, group)
            t1 = time.perf_counter()
            result = fn(*args, **kwargs)
            totals["wait"] += t1 - t0
            totals["move"] += time.perf_counter() - t1
            totals["calls"] += 1
            return result
        return call

    def route_of(values, key, dtype=None, lengths=None):
        path = groups.route(key)
        return path.ranks, (groups.route_group(key) if len(path.ranks) > 2 and dist.get_rank() in path.ranks
                            else None)

    def group_of(seqs, dst, group=None, **kwargs):
        return exchange.group_ranks(group), group

    rl_exchange.share = timed(rl_exchange.share, route_of)
    exchange.gather_ragged = timed(exchange.gather_ragged, group_of)
    benchlib.on_each_rl_step(lambda: per_step.append(dict(totals)))

    def write() -> None:
        # every rank has left the recipe's final barrier: the ranks are in step for timing bare barriers
        start = time.perf_counter()
        for _ in range(20):
            dist.barrier()
        barrier_s = (time.perf_counter() - start) / 20  # a 6-rank barrier: the dearest synchronisation used
        steps = [{k: s[k] - (per_step[i - 1][k] if i else 0) for k in s} for i, s in enumerate(per_step)]
        (out_dir / EXCHANGE_FILE.format(rank=dist.get_rank())).write_text(
            json.dumps({"steps": steps, "barrier_s": barrier_s}))

    return benchlib.run_ppo_then(write, ppo_args)


# ------------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="RL steps in the run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--placement", default="actor=1,critic=1,ref=1,reward=1,rollout=2")
    parser.add_argument("--rows", type=int, default=1024, help="prompts loaded (set-up cost only)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    benchlib.ensure_assets()
    from hpc_rlhf.dist.placement import world_size_of

    nproc = world_size_of(args.placement)
    benchlib.header(f"PPO step phases, placement {args.placement} ({nproc} ranks, 1 thread each)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        actor, value = benchlib.random_actor_and_value(tmp)
        out = tmp / "ppo"
        out.mkdir()
        ppo_args = ["--config", str(benchlib.REPO / "examples/tiny/ppo.yaml"), f"output_dir={out}",
                    f"placement={args.placement}", f"actor.path={actor}", f"critic.path={value}",
                    f"reward.models=[{value}]", f"train.max_steps={args.steps}", f"critic_train.max_steps={args.steps}",
                    f"data.train_files=[{benchlib.DATA / 'prompts_train.jsonl'}]", f"data.max_train_rows={args.rows}",
                    "data.eval_files=[]", "log.every_steps=1", "log.eval_every_steps=0", "log.tensorboard=false",
                    "log.progress=false", "checkpoint.resume=false"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--max_restarts=0", str(Path(__file__).resolve()), "--worker", str(out), *ppo_args]
        started = time.perf_counter()
        benchlib.run_command(cmd, what="6-rank PPO", timeout=1200)
        wall = time.perf_counter() - started
        metrics = sorted((r for r in benchlib.read_jsonl(out / "metrics.jsonl") if "time_step" in r),
                         key=lambda r: r["step"])
        ranks = [json.loads((out / EXCHANGE_FILE.format(rank=r)).read_text()) for r in range(nproc)]
    report(args, metrics, ranks, wall)
    return 0


def report(args, metrics: list[dict], ranks: list[dict], wall: float) -> None:
    timed = metrics[args.warmup:]
    steady = range(args.warmup, len(metrics))
    med = {key: benchlib.median(r[key] for r in timed) for key in (*PHASES, "time_step", "samples_per_s")}
    move0 = benchlib.median(ranks[0]["steps"][i]["move"] for i in steady)
    wait0 = benchlib.median(ranks[0]["steps"][i]["wait"] for i in steady)
    move_max = benchlib.median(max(rk["steps"][i]["move"] for rk in ranks) for i in steady)
    calls = ranks[0]["steps"][args.warmup]["calls"]
    barrier = benchlib.median(rk["barrier_s"] for rk in ranks)
    step = med["time_step"]
    print(f"   models: random init (llama-tiny actor/ref, value-model critic/reward) - timing only, not learning")
    print(f"   {len(metrics)} RL steps ({len(timed)} after warmup), 16 prompts x 4 samples, 6 new tokens; "
          f"whole run {wall:.0f} s wall (start-up included)")
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
    print(f"\n   {calls} exchange calls per step on rank 0, each preceded by a synchronisation of its ranks costing "
          f"at most ~{barrier * 1e3:.1f} ms (a barrier of all {len(ranks)} ranks), so at most "
          f"~{calls * barrier:.3f} s per step ({calls * barrier / step:.1%} of it) is the "
          f"instrumentation's own; {med['samples_per_s']:.1f} samples/s")


if __name__ == "__main__":
    sys.exit(main())
