"""GRPO (and RLOO) completions per second: hpc_rlhf's RL recipe against TRL's GRPOTrainer / RLOOTrainer.

Matched on both sides (DESIGN §11): the benchmark Llama (random init, fp32, sdpa), the built-in addition
prompts, the exact-match rule reward, 16 prompts x 8 samples = 128 completions per generation round, at most 8
new tokens, temperature 1, trained as two optimizer steps of 64 completions (micro-batches of 32), one policy
epoch, clip 0.2, lr 5e-5, KL to a frozen reference model with beta 0.02:
  - GRPO: group-normalised advantages, KL (k3) as a loss term, token-mean loss over the micro-batch
    (TRL: loss_type="bnpo", scale_rewards="group"; TRL's default beta=0 would skip the reference model);
  - RLOO: leave-one-out baseline, KL (k1) subtracted from the sequence reward.

hpc_rlhf runs as `python -m hpc_rlhf grpo ...` in its own processes, one thread per rank, in two layouts:
  disjoint   actor=1,ref=1,rollout=2      4 ranks: generation, scoring and training on different processes
  hybrid     actor+ref=1,rollout@actor    1 rank: the actor generates itself, nothing is sent
TRL runs in this process (one process, one thread). In every round each side runs once, back to back, in an
order rotated from round to round. A run's figure is 128 completions / its median RL-step time after the
warmup steps, from the wall clock between step ends (hpc_rlhf: the `time` of consecutive metrics.jsonl rows;
TRL: a callback at every optimizer step, two per RL step). Rates are medians over rounds; ratios are the
median of the per-round ratios, since runs of the same round saw about the same load.
Note the disjoint layout uses 4 processes against TRL's one: on a 2-core machine they compete for the cores.

`--task long-tailed`: both sides read the length-varied task instead (benchlib.write_long_tailed_prompts: sums of
2-24 numbers, prompts of 5-72 tokens; its prompt and response limits, benchlib.LONG_TAILED, with up to 48 new
tokens); `--set KEY=VALUE` adds a setting to hpc_rlhf's runs (e.g. rl.padding_free=true). `--alternate KEY=VALUE`
runs each hpc_rlhf layout twice a round, without and with the setting, in the rotated order with TRL: a before/after
of the same load, with the per-round ratio of the two.

    .venv/bin/python benchmarks/grpo_vs_trl.py                       # GRPO, 3 rounds
    .venv/bin/python benchmarks/grpo_vs_trl.py --algos grpo rloo --rounds 3 --steps 20
    .venv/bin/python benchmarks/grpo_vs_trl.py --task long-tailed --set rl.padding_free=false \
        --alternate rl.padding_free=true
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

PROMPTS_PER_STEP = 16
GROUP = 8
MAX_NEW_TOKENS = 8
OPT_BATCH = 64  # completions per optimizer step
MICRO = 32
BETA = 0.02
LR = 5e-5
LAYOUTS = {"disjoint": "actor=1,ref=1,rollout=2", "hybrid": "actor+ref=1,rollout@actor"}


# ------------------------------------------------------------------------------------------- hpc_rlhf side
def hpc_overrides(algo: str, placement: str, model_dir: Path, out_dir: Path, rl_steps: int, rows: int,
                  task: list[str]) -> list[str]:
    """The run's settings; `task`: its prompt file and length limits (task_settings)."""
    kl = (["rl.advantage=grpo", "rl.kl_estimator=k3", "rl.kl_in_reward=false"] if algo == "grpo" else
          ["rl.advantage=rloo", "rl.kl_estimator=k1", "rl.kl_in_reward=true"])
    return [f"output_dir={out_dir}", f"placement={placement}", f"actor.path={model_dir}", "actor.dtype=float32",
            "actor.attn_implementation=sdpa", "reward.models=[]", "reward.functions=[exact_match]",
            f"rollout.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.n_samples={GROUP}",
            f"rollout.max_new_tokens={MAX_NEW_TOKENS}", "rollout.temperature=1.0", *kl, f"rl.kl_coef={BETA}",
            "rl.loss_agg=token-mean", "rl.clip_eps=0.2", "rl.ppo_epochs=1", f"train.lr={LR}",
            f"train.batch_size={OPT_BATCH}", f"train.micro_batch_size={MICRO}", f"train.max_steps={rl_steps}",
            "train.warmup_steps=0", *task, f"data.max_train_rows={rows}", "data.eval_files=[]",
            "log.every_steps=1", "log.eval_every_steps=0", "log.tensorboard=false", "log.progress=false",
            "checkpoint.resume=false"]


def task_settings(task: str, tmp: Path, rows: int) -> tuple[Path, list[str], int]:
    """(the prompt file, hpc_rlhf's settings for it, the most new tokens) of `--task`."""
    if task == "tiny":
        prompts = benchlib.DATA / "prompts_train.jsonl"
        return prompts, [f"data.train_files=[{prompts}]"], MAX_NEW_TOKENS
    prompts = benchlib.write_long_tailed_prompts(tmp / "long_tailed_prompts.jsonl", rows)
    return prompts, benchlib.long_tailed_settings(prompts), benchlib.LONG_TAILED["rollout.max_new_tokens"]


def run_hpc(algo: str, layout: str, model_dir: Path, out_dir: Path, steps: int, warmup: int,
            rows: int, task: list[str]) -> float:
    """Completions per second of `hpc-rlhf grpo` in `layout`: 128 / the median RL step time after `warmup`."""
    cmd = [sys.executable, "-m", "hpc_rlhf", "grpo",
           *hpc_overrides(algo, LAYOUTS[layout], model_dir, out_dir, warmup + steps, rows, task)]
    benchlib.run_command(cmd, what=f"hpc_rlhf {algo} ({layout})", timeout=900)
    times = benchlib.rl_step_times_from_metrics(benchlib.read_jsonl(out_dir / "metrics.jsonl"), warmup)
    return PROMPTS_PER_STEP * GROUP / benchlib.median(times)


# ------------------------------------------------------------------------------------------------ TRL side
def exact_match_reward(completions, answer, **_):
    """TRL reward function: the same exact-match rule as hpc_rlhf's `exact_match` reward."""
    from hpc_rlhf.data.synthetic import exact_match

    return [exact_match(c, a) for c, a in zip(completions, answer)]


def run_trl(algo: str, model_dir: Path, out_dir: Path, steps: int, warmup: int, rows: int, prompts: Path,
            max_new_tokens: int) -> float:
    """Completions per second of TRL's trainer: 128 / the median RL step (2 optimizer steps, one generation
    round) time after `warmup` RL steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, TrainingArguments

    clock = benchlib.StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    updates_per_rl_step = PROMPTS_PER_STEP * GROUP // OPT_BATCH
    common = dict(output_dir=str(out_dir), per_device_train_batch_size=MICRO,
                  gradient_accumulation_steps=OPT_BATCH // MICRO,
                  steps_per_generation=PROMPTS_PER_STEP * GROUP // MICRO, num_generations=GROUP,
                  max_completion_length=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=BETA,
                  epsilon=0.2, num_iterations=1, learning_rate=LR, lr_scheduler_type="constant",
                  max_steps=(warmup + steps) * updates_per_rl_step, adam_beta2=0.95, max_grad_norm=1.0,
                  use_cpu=True, bf16=False, fp16=False, report_to="none",
                  logging_strategy="no", save_strategy="no", seed=0, disable_tqdm=True, use_vllm=False,
                  dataloader_num_workers=0, **benchlib.no_recomputation(TrainingArguments))
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]}
                              for r in benchlib.read_jsonl(prompts)[:rows]])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    if algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, loss_type="bnpo", scale_rewards="group")
        trainer = GRPOTrainer(model=model, reward_funcs=[exact_match_reward], args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Clock()])
    else:
        from trl import RLOOConfig, RLOOTrainer

        args = RLOOConfig(**common, normalize_advantages=False)
        trainer = RLOOTrainer(model=model, reward_funcs=[exact_match_reward], args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Clock()])
    with quiet_stdout():
        trainer.train()
    # TRL generates once per RL step (every `updates_per_rl_step` optimizer steps): time whole RL steps
    times = benchlib.grouped_step_times(clock.stamps, updates_per_rl_step, warmup)
    return PROMPTS_PER_STEP * GROUP / benchlib.median(times)


@contextlib.contextmanager
def quiet_stdout():
    """TRL prints completion tables and summaries; the benchmark's own lines are what should show."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


# ------------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo"], choices=["grpo", "rloo"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed RL steps (128 completions each) per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed RL steps at the start of every run")
    parser.add_argument("--rows", type=int, default=1024, help="prompts loaded (set-up cost only)")
    benchlib.add_task_arguments(parser)
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")

    benchlib.set_torch_threads()
    benchlib.ensure_assets()
    import trl  # noqa: F401  (fail before any measurement when TRL is missing)

    benchlib.header("GRPO/RLOO completions per second: hpc_rlhf vs TRL")
    alternated, runs = benchlib.alternated_sides(args.layouts, args.alternate)  # side -> its layout, settings
    sides = [*runs, "trl"]
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = benchlib.make_bench_model(tmp / "bench-llama")
        prompts, task, max_new_tokens = task_settings(args.task, tmp, args.rows)
        task += args.set
        print(f"   model: Llama h128 x 2 layers, {benchlib.count_params(model_dir):,} parameters, fp32; task "
              f"{args.task}: {PROMPTS_PER_STEP} prompts x {GROUP} samples, {max_new_tokens} new tokens, beta {BETA}; "
              f"{args.steps} timed RL steps after {args.warmup}; {args.rounds} rounds; hpc_rlhf "
              f"{' '.join(args.set) or 'as configured'}", flush=True)
        for r in range(args.rounds):
            for algo in args.algos:
                order = sides[r % len(sides):] + sides[:r % len(sides)]  # rotate who goes first
                for side in order:
                    out = tmp / f"{algo}-{sides.index(side)}-{r}"
                    if side == "trl":
                        value = run_trl(algo, model_dir, out, args.steps, args.warmup, args.rows, prompts,
                                        max_new_tokens)
                    else:
                        layout, settings = runs[side]
                        value = run_hpc(algo, layout, model_dir, out, args.steps, args.warmup, args.rows,
                                        task + settings)
                    results.setdefault((algo, side), []).append(value)
                    print(f"   round {r + 1} {algo} {side:<30} {value:7.1f} completions/s", flush=True)
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows = []
    for algo in args.algos:
        trl_rounds = results[(algo, "trl")]
        for side in sides:
            values = results[(algo, side)]
            paired = [v / t for v, t in zip(values, trl_rounds)]  # same round: the same load, near in time
            processes = 1 if side == "trl" else {"disjoint": 4, "hybrid": 1}[runs[side][0]]
            rows.append([algo, side, processes, benchlib.median(values), benchlib.spread(values),
                         "" if side == "trl" else f"{benchlib.median(paired):.2f}x ({benchlib.spread(paired)})"])
    print(benchlib.table(["algo", "side", "processes", "completions/s (median)", "min-max",
                          "vs TRL (median of per-round ratios, min-max)"], rows))
    if args.alternate:
        pairs = []
        for algo in args.algos:
            for layout in args.layouts:
                after = results[(algo, f"hpc_rlhf {layout} {alternated}")]
                before = results[(algo, f"hpc_rlhf {layout}")]
                paired = [a / b for a, b in zip(after, before)]
                pairs.append([algo, layout, f"{benchlib.median(paired):.2f}x ({benchlib.spread(paired)})"])
        print(f"\n   {alternated} against without, per round:")
        print(benchlib.table(["algo", "layout", "completions/s ratio (median, min-max)"], pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
