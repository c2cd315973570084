"""PPO episodes per second: hpc_rlhf's PPO recipe against TRL 1.12's PPOTrainer (trl.experimental.ppo).

TRL removed PPOTrainer in 1.13, so its side runs in a separate environment, `.venv-trl112`: the project venv's
packages plus trl 1.12.0 installed over them without dependencies (see benchmarks/README.md for the two
commands). Everything else is matched, one thread per process:
  - policy and reference: the benchmark Llama (355K parameters, random init, fp32, sdpa);
  - critic and reward model: the same body with a new scalar head (random: the timing does not depend on
    what it scores; hpc_rlhf uses token-classification folders, TRL sequence-classification models);
  - 64 prompts per step, one response each (TRL's PPO samples one per prompt), at most 6 new tokens,
    temperature 1, KL (k1) penalty 0.02 in the reward, GAE gamma 1 / lambda 0.95, clip 0.2 / value clip 0.2,
    one PPO epoch of one optimizer step on all 64 episodes (micro-batches of 32), lr 5e-5.
hpc_rlhf runs in two layouts: `disjoint` (actor, critic, ref, reward and two rollout engines on 6 ranks) and
`colocated` (all roles and the hybrid engine on 1 rank: `actor+critic+ref+reward=1,rollout@actor`). TRL runs
one process (policy and value trained together). A run's figure is 64 episodes / its median step time (wall
time between step ends) after the warmup steps; median over the rounds; the order of the sides rotates from round to
round, and ratios are medians of the per-round ratios (runs of one round saw about the same load).

`--task long-tailed`: both sides read the length-varied task instead (benchlib.write_long_tailed_prompts: sums of
2-24 numbers, prompts of 5-72 tokens, up to 48 new tokens: benchlib.LONG_TAILED). `--set KEY=VALUE` adds a setting
to hpc_rlhf's runs; `--alternate KEY=VALUE` runs each hpc_rlhf layout twice a round, without and with the setting,
in the rotated order with TRL, and prints the per-round ratio of the two.

    .venv/bin/python benchmarks/ppo_vs_trl.py
    .venv/bin/python benchmarks/ppo_vs_trl.py --layouts colocated --rounds 3 --steps 20
    .venv/bin/python benchmarks/ppo_vs_trl.py --task long-tailed --set rl.padding_free=false \
        --alternate rl.padding_free=true
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

EPISODES = 64
MICRO = 32
NEW_TOKENS = 6
KL = 0.02
LR = 5e-5
LAYOUTS = {"disjoint": "actor=1,critic=1,ref=1,reward=1,rollout=2",
           "colocated": "actor+critic+ref+reward=1,rollout@actor"}
TRL_VENV = benchlib.REPO / ".venv-trl112"


# ------------------------------------------------------------------------------------------- hpc_rlhf side
def run_hpc(layout: str, actor: Path, value: Path, out: Path, steps: int, warmup: int, rows: int,
            task: list[str]) -> float:
    """Episodes per second of `hpc-rlhf ppo` in `layout`; `task`: settings after the matched ones (the task's
    prompt file and lengths, --set, --alternate)."""
    args = ["--config", str(benchlib.REPO / "examples/tiny/ppo.yaml"), f"output_dir={out}",
            f"placement={LAYOUTS[layout]}", f"actor.path={actor}", "actor.dtype=float32", f"critic.path={value}",
            "critic.dtype=float32", f"reward.models=[{value}]", f"rollout.prompts_per_step={EPISODES}",
            "rollout.n_samples=1", "rollout.temperature=1.0",
            "rl.advantage=gae", f"rl.kl_coef={KL}", "rl.kl_estimator=k1", "rl.kl_in_reward=true", "rl.gamma=1.0",
            "rl.lam=0.95", "rl.clip_eps=0.2", "rl.value_clip_eps=0.2", "rl.ppo_epochs=1", f"train.lr={LR}",
            f"train.batch_size={EPISODES}", f"train.micro_batch_size={MICRO}", f"critic_train.batch_size={EPISODES}",
            f"critic_train.micro_batch_size={MICRO}", f"train.max_steps={warmup + steps}",
            f"critic_train.max_steps={warmup + steps}",
            f"data.max_train_rows={rows}",
            "data.eval_files=[]", "log.every_steps=1", "log.eval_every_steps=0", "log.tensorboard=false",
            "log.progress=false", "checkpoint.resume=false", *task]
    benchlib.run_command([sys.executable, "-m", "hpc_rlhf", "ppo", *args], what=f"hpc_rlhf ppo ({layout})",
                         timeout=1200)
    times = benchlib.rl_step_times_from_metrics(benchlib.read_jsonl(out / "metrics.jsonl"), warmup)
    return EPISODES / benchlib.median(times)


# ------------------------------------------------------------------------------------------------ TRL side
def trl_worker(actor: Path, out: Path, steps: int, warmup: int, rows: int, prompt_file: Path,
               new_tokens: int) -> int:
    """Runs inside .venv-trl112: TRL 1.12's PPOTrainer; writes the step-end timestamps to out/steps.json."""
    import contextlib

    import torch
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    benchlib.set_torch_threads()
    clock = benchlib.StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    tokenizer = AutoTokenizer.from_pretrained(str(actor))
    tokenizer.padding_side = "left"  # TRL's PPO generates from left-padded queries

    def causal_lm():
        return AutoModelForCausalLM.from_pretrained(str(actor), dtype=torch.float32, attn_implementation="sdpa")

    def value_model():
        torch.manual_seed(1)
        return AutoModelForSequenceClassification.from_pretrained(str(actor), num_labels=1, dtype=torch.float32,
                                                                  attn_implementation="sdpa")

    prompts = [r["prompt"] for r in benchlib.read_jsonl(prompt_file)[:rows]]
    data = Dataset.from_list([{"input_ids": tokenizer(p)["input_ids"]} for p in prompts])
    config = PPOConfig(output_dir=str(out), per_device_train_batch_size=MICRO,
                       gradient_accumulation_steps=EPISODES // MICRO, num_mini_batches=1, num_ppo_epochs=1,
                       total_episodes=EPISODES * (warmup + steps), response_length=new_tokens, temperature=1.0,
                       kl_coef=KL, kl_estimator="k1", gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2,
                       stop_token="eos", missing_eos_penalty=None, local_rollout_forward_batch_size=EPISODES,
                       num_sample_generations=0, learning_rate=LR, lr_scheduler_type="constant", adam_beta2=0.95,
                       max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
                       seed=0, disable_tqdm=True, dataloader_num_workers=0, **benchlib.no_recomputation(PPOConfig))
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=causal_lm(), ref_model=causal_lm(),
                         reward_model=value_model(), value_model=value_model(), train_dataset=data,
                         eval_dataset=data.select(range(EPISODES)), callbacks=[Clock()])
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # TRL prints every step's metrics
        trainer.train()
    import trl

    (out / "steps.json").write_text(json.dumps({"stamps": clock.stamps, "trl": trl.__version__}))
    return 0


def run_trl(actor: Path, out: Path, steps: int, warmup: int, rows: int, prompt_file: Path,
            new_tokens: int) -> tuple[float, str]:
    """(episodes/s, TRL version) of the TRL 1.12 worker."""
    python = TRL_VENV / "bin" / "python"
    out.mkdir(parents=True, exist_ok=True)
    benchlib.run_command([str(python), str(Path(__file__).resolve()), "--trl-worker", str(actor), str(out),
                          str(steps), str(warmup), str(rows), str(prompt_file), str(new_tokens)],
                         what="TRL 1.12 PPO", timeout=1200)
    result = json.loads((out / "steps.json").read_text())
    times = benchlib.grouped_step_times(result["stamps"], 1, warmup)  # one optimizer step per PPO step here
    return EPISODES / benchlib.median(times), result["trl"]


# ------------------------------------------------------------------------------------------------ driver
def make_models(folder: Path) -> tuple[Path, Path]:
    from hpc_rlhf.config import ModelSection
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.models.value_model import build_value_model, save_value_model

    actor = benchlib.make_bench_model(folder / "bench-llama")
    value = folder / "bench-value"
    model = build_value_model(ModelSection(path=str(actor), dtype="float32"), for_training=False)
    save_value_model(model, value, tokenizer=load_tokenizer(actor))
    return actor, value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--trl-worker"]:
        actor, out, steps, warmup, rows, prompt_file, new_tokens = argv[1:8]
        return trl_worker(Path(actor), Path(out), int(steps), int(warmup), int(rows), Path(prompt_file),
                          int(new_tokens))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed PPO steps (64 episodes each) per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1024, help="prompts loaded (set-up cost only)")
    benchlib.add_task_arguments(parser)
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")
    if not (TRL_VENV / "bin" / "python").exists():
        print(f"{TRL_VENV} is missing: create it as benchmarks/README.md says (TRL 1.12 for PPOTrainer)",
              file=sys.stderr)
        return 2
    benchlib.ensure_assets()
    benchlib.header("PPO episodes per second: hpc_rlhf vs TRL 1.12 PPOTrainer")
    alternated, runs = benchlib.alternated_sides(args.layouts, args.alternate)  # side -> its layout, settings
    sides = [*runs, "trl 1.12"]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        actor, value = make_models(tmp)
        if args.task == "tiny":
            prompt_file, new_tokens = benchlib.DATA / "prompts_train.jsonl", NEW_TOKENS
            task = [f"data.train_files=[{prompt_file}]", f"rollout.max_new_tokens={NEW_TOKENS}"]
        else:
            prompt_file = benchlib.write_long_tailed_prompts(tmp / "long_tailed_prompts.jsonl", args.rows)
            task = benchlib.long_tailed_settings(prompt_file)
            new_tokens = benchlib.LONG_TAILED["rollout.max_new_tokens"]
        task += args.set
        print(f"   model: Llama h128 x 2 layers, {benchlib.count_params(actor):,} parameters (policy, ref; critic and "
              f"reward the same body + scalar head), random init; task {args.task}: {EPISODES} episodes/step, "
              f"{new_tokens} new tokens; {args.steps} timed steps after {args.warmup}; {args.rounds} round(s); "
              f"hpc_rlhf {' '.join(args.set) or 'as configured'}", flush=True)
        for r in range(args.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                out = tmp / f"{sides.index(side)}-{r}"
                if side.startswith("trl"):
                    value_s, version = run_trl(actor, out, args.steps, args.warmup, args.rows, prompt_file,
                                               new_tokens)
                    if r == 0:
                        print(f"   TRL side: trl {version} from {TRL_VENV.name}", flush=True)
                else:
                    layout, settings = runs[side]
                    value_s = run_hpc(layout, actor, value, out, args.steps, args.warmup, args.rows,
                                      task + settings)
                results.setdefault(side, []).append(value_s)
                print(f"   round {r + 1} {side:<30} {value_s:7.1f} episodes/s", flush=True)
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows = []
    for side in sides:
        paired = [v / t for v, t in zip(results[side], results["trl 1.12"])]  # same round, about the same load
        processes = 1 if side.startswith("trl") else {"disjoint": 6, "colocated": 1}[runs[side][0]]
        rows.append([side, processes, benchlib.median(results[side]), benchlib.spread(results[side]),
                     "" if side.startswith("trl") else f"{benchlib.median(paired):.2f}x"])
    print(benchlib.table(["side", "processes", "episodes/s (median)", "min-max", "vs TRL (per-round ratios, median)"],
                         rows))
    if args.alternate:
        pairs = []
        for layout in args.layouts:
            after, before = results[f"hpc_rlhf {layout} {alternated}"], results[f"hpc_rlhf {layout}"]
            paired = [a / b for a, b in zip(after, before)]
            pairs.append([layout, f"{benchlib.median(paired):.2f}x ({benchlib.spread(paired)})"])
        print(f"\n   {alternated} against without, per round:")
        print(benchlib.table(["layout", "episodes/s ratio (median, min-max)"], pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
