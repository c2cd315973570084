"""LoRA RL against full fine-tuning (issue 27), side by side in one run, on a 59.6M-parameter Llama (the model of
memory_scaling.py: hidden 640, MLP 1728, 12 layers, the shipped character tokenizer; fp32 on CPU):

1. One weight sync, the RL step's own code on 2 gloo ranks: rank 0 holds the actor, rank 1 an hf rollout engine.
   Full: the fully fine-tuned actor's weights (`models.lora.merged_tensors`, what `TrainEngine.full_state`
   streams), received into the engine as the full sync does (`weight_sync.receive_into`). LoRA rank 8 on q, k, v, o:
   the adapter alone (`adapter_tensors`, what `TrainEngine.adapter_state` streams) into the engine's own copy of the
   base (`HFRolloutEngine.load_adapter`). Both with `reuse_layout` (the RL step's steady state) and the default
   256 MB buckets, taking turns `--repeats` times after one warm-up each; a sync is timed from a barrier before it
   to a barrier after the engine has loaded everything. Bytes and median seconds, and their ratios.
2. GRPO (`hpc-rlhf grpo`, disjoint, one hf engine, `--steps` steps each, a rule reward every response earns from so
   that the actor moves from the first step), one run after the other, `--rounds` rounds in alternating order (runs
   cannot take turns step by step, so on a shared machine the load moves between them: compare within a round):
       full       actor=1,ref=1,rollout=1   full fine-tuning, the reference a model of its own
       lora+ref   actor=1,ref=1,rollout=1   LoRA r8, ref_mode=model: the reference a model of its own
       lora       actor=1,rollout=1         LoRA r8, the reference = the actor with its adapter off (the default)
   Per run: `weight_sync_mb` and `time_sync` as logged (median over the steps after the first), samples/s (median;
   the ratios are medians of the rounds' ratios),
   and the peak resident memory of the actor's and the reference's ranks over the steps, less each rank's memory
   before its models were built (as memory_scaling.py measures it: RSS sampled every 2 ms and after every module's
   forward, malloc returning freed blocks to the kernel).
3. The planner's estimate (`hpc-rlhf plan --lora-rank 8`, dist/memory.py) for 70B layouts, LoRA against full.

Nothing is asserted; the ratios are the figures to keep (README.md, "LoRA RL").

    .venv/bin/python benchmarks/lora_rl.py
    .venv/bin/python benchmarks/lora_rl.py --repeats 9 --steps 6 --json
    .venv/bin/python benchmarks/lora_rl.py --smoke     # does it run (the suite's smoke run): no figures to keep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

MODEL = {"hidden_size": 640, "intermediate_size": 1728, "num_hidden_layers": 12, "num_attention_heads": 10,
         "num_key_value_heads": 10}
SMOKE_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4}  # --smoke: that it runs, on a model that loads at once
RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MB = 2**20
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
RUNS = {  # name: placement, overrides
    "full": ("actor=1,ref=1,rollout=1", []),
    "lora+ref": ("actor=1,ref=1,rollout=1", [f"actor.lora.rank={RANK}", "ref_mode=model"]),
    "lora": ("actor=1,rollout=1", [f"actor.lora.rank={RANK}"]),
}
LAYOUTS_70B = [  # (what, GPUs per node, placement, LoRA rank)
    ("full, 32 GPUs", 8, "actor=16,ref=8,rollout=8,rollout_tp=8", 0),
    ("full, 16 GPUs", 8, "actor=8,ref=4,rollout=4,rollout_tp=4", 0),
    ("LoRA r8, 16 GPUs", 8, "actor=8,rollout=8,rollout_tp=4", RANK),
    ("LoRA r8, 8 GPUs", 8, "actor=4,rollout=4,rollout_tp=4", RANK),
    ("LoRA r8, 8 GPUs, separate ref", 8, "actor=4,ref=2,rollout=2,rollout_tp=2", RANK),
]


def lora_section():
    from hpc_rlhf.config import LoraSection

    return LoraSection(rank=RANK, alpha=2.0 * RANK, target_modules=TARGETS)


# ------------------------------------------------------------------------------------------ 1. one weight sync
def sync_worker(model: str, out: Path, repeats: int) -> int:
    import statistics

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.dist import weight_sync
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
    from hpc_rlhf.models.lora import adapter_tensors, apply_lora, merged_tensors

    benchlib.set_torch_threads()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # the weight-sync group (the actor's leader and the engine's rank), one per kind: a sender remembers the layout
    # it reuses per group, and a job streams one kind only
    groups = {"full": dist.new_group([0, 1]), "lora": dist.new_group([0, 1])}

    def model_copy():
        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

    if rank == 0:  # the two actors: fully fine-tuned, and LoRA (its adapter moved, so that it is not zeros)
        full = model_copy()
        lora = apply_lora(model_copy(), lora_section())
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if ".lora_B." in name:
                    p.normal_(std=0.01)
        streams = {"full": lambda: merged_tensors(full), "lora": lambda: adapter_tensors(lora)}
    else:  # the engines: a copy of the model, and a copy of the base with the adapter's place
        engines = {"full": HFRolloutEngine(model_copy().eval(), pad_id=0, eos_id=2),
                   "lora": HFRolloutEngine(apply_lora(model_copy(), lora_section()).requires_grad_(False).eval(),
                                           pad_id=0, eos_id=2)}
    seconds = {"full": [], "lora": []}
    sent = {}
    for repeat in range(repeats + 1):  # the first of each is a warm-up (the layout's first, described sync)
        for kind in ("full", "lora"):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                stats = weight_sync.send_weights(streams[kind](), src=0, group=groups[kind], bucket_mb=256,
                                                 reuse_layout=True)
                sent[kind] = stats.bytes
            elif kind == "full":
                weight_sync.receive_into(engines[kind], src=0, group=groups[kind])
            else:
                weight_sync.receive_weights(src=0, group=groups[kind], load_fn=engines[kind].load_adapter)
            dist.barrier()
            if repeat:
                seconds[kind].append(time.perf_counter() - start)
    if rank == 0:
        out.write_text(json.dumps({"bytes": sent, "seconds": seconds,
                                   "median": {k: statistics.median(v) for k, v in seconds.items()}}))
    dist.destroy_process_group()
    return 0


def one_sync(model: Path, tmp: Path, repeats: int, launcher: str = "torchrun") -> dict:
    out = tmp / "sync.json"
    benchlib.run_ranks(2, Path(__file__).resolve(), ["--sync-worker", str(model), str(out), str(repeats)], launcher,
                       main, what="weight sync, full and LoRA", timeout=1200)
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------ 2. GRPO runs
def grpo_worker(out: Path, args: list[str]) -> int:
    """One rank of a GRPO run: its roles, its RSS before its models were built, its peak RSS over the steps."""
    from hpc_rlhf import cli
    from hpc_rlhf.dist import groups, watchdog
    from hpc_rlhf.rl import grpo
    from hpc_rlhf.rl import step as rl_step

    page = os.sysconf("SC_PAGE_SIZE")
    state = {"baseline": None, "window": False, "peak": 0, "roles": []}

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def sample(*_) -> None:
        if state["window"]:
            state["peak"] = max(state["peak"], rss())

    def sampler() -> None:
        while True:
            sample()
            time.sleep(0.002)

    import torch

    setup = rl_step.RLRecipe.setup

    def setup_and_note(self):  # the rank's memory before any model exists, and its roles
        state["baseline"] = rss()
        setup(self)
        state["roles"] = [name for name in self.plan.roles if groups.has_role(name)]

    rl_step.RLRecipe.setup = setup_and_note
    set_step = watchdog.set_step

    def start_window(step: int) -> None:  # the recipe announces step 1: the window opens
        state["window"] = True
        set_step(step)

    watchdog.set_step = start_window
    run = grpo.run

    def measured_run(cfg, *a, **kw):  # in the rank's own process (forked ranks inherit the patches, not threads)
        threading.Thread(target=sampler, daemon=True).start()
        torch.nn.modules.module.register_module_forward_hook(sample)
        result = run(cfg, *a, **kw)
        sample()
        (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(state))
        return result

    grpo.run = measured_run  # the CLI looks the mode's run function up when it starts it
    return cli.main(args)


def grpo_run(name: str, model: Path, tmp: Path, steps: int, rule: Path, launcher: str = "torchrun") -> dict:
    placement, overrides = RUNS[name]
    out = tmp / name
    out.mkdir(parents=True)
    ranks = len(placement.split(","))
    args = ["grpo", "--config", str(benchlib.REPO / "examples/tiny/grpo.yaml"), f"output_dir={out / 'run'}",
            f"placement={placement}", f"actor.path={model}", "reward.models=[]", f"reward.functions=[{rule}:length]",
            f"actor.lora.alpha={2.0 * RANK}", f"actor.lora.target_modules=[{','.join(TARGETS)}]",
            f"train.max_steps={steps}", "rollout.prompts_per_step=8", "rollout.n_samples=4",
            "rollout.max_new_tokens=8", "train.batch_size=32", "train.micro_batch_size=8", "train.lr=1e-4",
            f"data.train_files=[{benchlib.DATA / 'prompts_train.jsonl'}]", "data.max_train_rows=256",
            "data.eval_files=[]", "log.eval_every_steps=0", "log.tensorboard=false", "log.progress=false",
            "checkpoint.every_steps=0", "checkpoint.resume=false", *overrides]
    started = time.perf_counter()
    benchlib.run_ranks(ranks, Path(__file__).resolve(), ["--grpo-worker", str(out), *args], launcher, main,
                       env=benchlib.child_env(MALLOC), what=f"GRPO {name}", timeout=1800)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    rows = benchlib.read_jsonl(out / "run" / "metrics.jsonl")[1:]  # the first step pays one-time costs

    def peak(role: str) -> float:
        over = [(r["peak"] - r["baseline"]) / MB for r in reports if role in r["roles"]]
        return max(over) if over else 0.0

    return {"sync_mb": benchlib.median(r["weight_sync_mb"] for r in rows),
            "sync_s": benchlib.median(r["time_sync"] for r in rows),
            "samples_per_s": benchlib.median(r["samples_per_s"] for r in rows),
            "actor_mb": peak("actor"), "ref_mb": peak("ref"), "seconds": time.perf_counter() - started}


# ------------------------------------------------------------------------------------------ 3. the planner
def planner_70b() -> list[list]:
    from hpc_rlhf.dist import plan_cli

    rows = []
    for what, per_node, placement, rank in LAYOUTS_70B:
        world = sum(int(part.split("=")[1]) for part in placement.split(",") if not part.startswith("rollout_tp"))
        args = plan_cli.build_parser().parse_args(["--world-size", str(world), "--gpus-per-node", str(per_node),
                                                   "--model", "70b", "--placement", placement,
                                                   "--lora-rank", str(rank)])
        result = plan_cli.compute(args)
        roles = result["roles"]

        def gb(role):
            return f"{roles[role]['memory_gb_per_rank']:.1f}" if role in roles else "-"

        sync_gb = result["lora"]["sync_gb"] if rank else 2 * result["model"]["params"] / 1e9
        rows.append([what, placement, gb("actor"), gb("ref"), gb("rollout"), f"{sync_gb:.3f}",
                     "yes" if result["fits"] else "NO"])
    return rows


# ------------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--sync-worker"]:
        return sync_worker(argv[1], Path(argv[2]), int(argv[3]))
    if argv[:1] == ["--grpo-worker"]:
        return grpo_worker(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="weight syncs of each kind, after a warm-up each")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=2, help="GRPO runs of each kind, in alternating order")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--smoke", action="store_true",
                        help="that it runs, not a measurement: a 2-layer model of hidden size 64, 1 repeat, 2 steps, "
                             "1 round, every rank forked from this process (benchlib.run_ranks)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.rounds = 1, 2, 1
    benchlib.ensure_assets()
    benchlib.header(f"LoRA RL (rank {RANK} on {', '.join(TARGETS)}) against full fine-tuning")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = benchlib.make_bench_model(tmp / "llama", seed=0, **(SMOKE_MODEL if args.smoke else MODEL))
        params = benchlib.count_params(model)
        rule = tmp / "rule.py"
        rule.write_text("def length(prompts, responses, answers):\n    return [float(len(r)) for r in responses]\n")
        print(f"   model: {params / 1e6:.1f}M parameters, {params * 4 / MB:.0f} MB in fp32\n")
        sync = one_sync(model, tmp, args.repeats, "local" if args.smoke else "torchrun")
        rounds = []
        for index in range(args.rounds):
            order = list(RUNS) if index % 2 == 0 else list(reversed(RUNS))
            done = {name: grpo_run(name, model, tmp / f"round{index}", args.steps, rule,
                                   "local" if args.smoke else "torchrun") for name in order}
            rounds.append({name: done[name] for name in RUNS})
    runs = {name: {key: benchlib.median(r[name][key] for r in rounds) for key in rounds[0][name]} for name in RUNS}
    full_b, lora_b = sync["bytes"]["full"], sync["bytes"]["lora"]
    full_s, lora_s = sync["median"]["full"], sync["median"]["lora"]
    print(f"1. one weight sync to one hf engine, 2 gloo ranks, median of {args.repeats}:")
    print(benchlib.table(["sync", "MB", "median s", "all s"], [
        ["full", full_b / MB, full_s, benchlib.spread(sync["seconds"]["full"])],
        [f"LoRA r{RANK}", lora_b / MB, lora_s, benchlib.spread(sync["seconds"]["lora"])],
        ["LoRA / full", f"{100 * lora_b / full_b:.2f}%", f"{100 * lora_s / full_s:.2f}%", ""]]))
    print(f"\n2. GRPO, {args.steps} steps each, {args.rounds} round(s) (medians over steps 2..{args.steps} and over "
          "the rounds; memory: peak - before the models):")
    print(benchlib.table(["run", "placement", "weight_sync_mb", "time_sync s", "samples/s", "samples/s per round",
                          "actor rank MB", "ref rank MB", "actor + ref MB", "run s"],
                         [[name, RUNS[name][0], r["sync_mb"], r["sync_s"], r["samples_per_s"],
                           " ".join(f"{rnd[name]['samples_per_s']:.3g}" for rnd in rounds), r["actor_mb"],
                           r["ref_mb"] or "-", r["actor_mb"] + r["ref_mb"], r["seconds"]]
                          for name, r in runs.items()]))
    lora, with_ref, full = runs["lora"], runs["lora+ref"], runs["full"]

    def per_round(a: str, b: str) -> float:
        return benchlib.median(rnd[a]["samples_per_s"] / rnd[b]["samples_per_s"] for rnd in rounds)

    ratios = {"sync_bytes_lora_vs_full": lora_b / full_b, "sync_seconds_lora_vs_full": lora_s / full_s,
              "grpo_sync_mb_lora_vs_full": lora["sync_mb"] / full["sync_mb"],
              "grpo_sync_s_lora_vs_full": lora["sync_s"] / full["sync_s"],
              "actor_plus_ref_mb_adapter_off_vs_ref_role": (lora["actor_mb"] + lora["ref_mb"]) /
              (with_ref["actor_mb"] + with_ref["ref_mb"]),
              "actor_mb_adapter_off_vs_ref_role": lora["actor_mb"] / with_ref["actor_mb"],
              "samples_per_s_adapter_off_vs_ref_role": per_round("lora", "lora+ref"),
              "samples_per_s_lora_vs_full": per_round("lora", "full")}
    print("\n   ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print("\n3. hpc-rlhf plan, Llama-2-70B, 80 GB GPUs, ZeRO-3, bf16, micro-batch 1 x 2048 tokens:")
    print(benchlib.table(["layout", "placement", "actor GB/rank", "ref GB/rank", "rollout GB/rank",
                          "sync GB", "fits"], planner_70b()))
    print(f"\n   machine after: {benchlib.machine_state()}")
    if args.json:
        print(json.dumps({"params": params, "sync": sync, "runs": runs, "rounds": rounds, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
