"""The step-time model (hpc_rlhf/scale/step_time.py) against measured steps: the tiny RL placements on this machine
(after `hpc-rlhf plan --calibrate`), and published runs of other RL systems. Prints the tables of
benchmarks/step_time.md.

    # measure (one after another, nothing else running), then compare:
    .venv/bin/python -m hpc_rlhf plan --calibrate
    .venv/bin/python benchmarks/rl_phases.py > ppo.txt
    .venv/bin/python benchmarks/rl_phases.py --config examples/tiny/grpo.yaml --placement actor=2,ref=1,rollout@actor \\
        > hybrid.txt
    .venv/bin/python benchmarks/rl_phases.py --config examples/tiny/grpo.yaml --placement actor=1,ref=1,rollout=2 \\
        --set rl.max_staleness=1 > async.txt
    .venv/bin/python benchmarks/step_time_validation.py --ppo ppo.txt --hybrid hybrid.txt --async async.txt

Each measured file may be given several times (repeated runs): the table shows the median and the range. The
published runs are predicted from the settings their authors report plus what is said under ASSUMED; their config
folders hold only the architecture's config.json (public figures, no weights).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_rlhf.dist.memory import load_shape  # noqa: E402
from hpc_rlhf.dist.placement import make_plan  # noqa: E402
from hpc_rlhf.scale import hardware, step_time  # noqa: E402

TINY = str(REPO / "hpc_rlhf/models/tiny/llama-tiny.json")
LOGGED = ("time_generate", "time_score", "time_train", "time_sync")

# The tiny runs of benchmarks/rl_phases.py: what examples/tiny/{ppo,grpo}.yaml set (prompts, samples, batch and
# micro-batch sizes, ZeRO-0 on CPU, no gradient checkpointing), prompts of at most 8 tokens ("78+93=" and the
# tokenizer's begin token), responses padded to max_new_tokens = 6 (random-init models rarely stop early).
TINY_COMMON = dict(prompt_len=8, response_len=6, micro_batch_size=32, train_batch=64, zero_stage=0,
                   gradient_checkpointing=False, rollout_seqs=256)
TINY_RUNS = {
    "ppo": ("disjoint PPO", "actor=1,critic=1,ref=1,reward=1,rollout=2", 6,
            dict(prompts=16, samples=4, **TINY_COMMON)),
    "hybrid": ("hybrid GRPO", "actor=2,ref=1,rollout@actor", 3,
               dict(prompts=16, samples=8, rollout_backend="hf", **TINY_COMMON)),
    "async": ("async GRPO (K=1)", "actor=1,ref=1,rollout=2", 4,
              dict(prompts=16, samples=8, max_staleness=1, **TINY_COMMON)),
}

# Published runs. NeMo RL v0.4 performance summary (docs/about/performance-summary.md of NVIDIA-NeMo/RL, "GRPO,
# Dataset: OpenMathInstruct-2, System: DGX-H100, Training BF16, Generation BF16, Megatron-core"):
# Llama 3.1 8B on 16 H100, 2,048 samples per step (G-GBS), training batch 512 (T-GBS), max sequence 4,096, mean
# generated sequence 1,060 (on policy) / 1,129 (1-step off policy), step 97.7 s / 74.6 s; Qwen3-32B on 32 H100,
# mean sequence 3,206, step 393 s (on policy).
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
PUBLISHED = [
    dict(name="NeMo RL GRPO Llama 3.1 8B, 16 H100, on policy", measured_s=97.7,
         config=LLAMA_31_8B,
         placement="actor+ref=16,rollout@actor", world=16,
         settings=dict(prompts=64, samples=32, prompt_len=150, response_len=910, max_response_len=3946,
                       train_batch=512, micro_batch_size=1, zero_stage=1, gradient_checkpointing=False,
                       rollout_seqs=256)),
    dict(name="NeMo RL GRPO Llama 3.1 8B, 16 H100, 1-step off policy", measured_s=74.6,
         config=LLAMA_31_8B,
         placement="actor+ref=8,rollout=8", world=16,
         settings=dict(prompts=64, samples=32, prompt_len=150, response_len=979, max_response_len=3946,
                       train_batch=512, micro_batch_size=1, zero_stage=1, gradient_checkpointing=False,
                       rollout_seqs=256, max_staleness=1)),
    dict(name="NeMo RL GRPO Qwen3-32B, 32 H100, on policy", measured_s=393.0,
         config={"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936},
         placement="actor+ref=32,rollout@actor,rollout_tp=4", world=32,
         settings=dict(prompts=64, samples=32, prompt_len=150, response_len=3056, max_response_len=3946,
                       train_batch=512, micro_batch_size=1, zero_stage=1, gradient_checkpointing=False,
                       rollout_seqs=256)),
]
ASSUMED = ("64 prompts x 32 samples per step (G-GBS 2,048); prompts of 150 tokens (OpenMathInstruct-2 problems in "
           "a chat template), so the mean response is the published mean sequence minus 150; the longest response "
           "of every engine's wave reaches the 4,096-token limit; the reference model's log-probs are computed "
           "(GRPO's KL term) on the training GPUs; Megatron's data parallelism with its distributed optimizer is "
           "modelled as ZeRO-1; micro-batches of 1; no activation recomputation; the 1-step off-policy run splits "
           "its 16 GPUs 8 for generation, 8 for training; the on-policy runs "
           "generate on the training GPUs (colocated vLLM, weights copied locally)")


def measured_phases(path: Path) -> dict[str, float]:
    """The phase medians rl_phases.py prints (rank 0)."""
    out = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^(generate|score|train|sync|step \(total\))\s+([0-9.e-]+)", line)
        if match:
            key = "time_step" if match.group(1).startswith("step") else f"time_{match.group(1)}"
            out[key] = float(match.group(2))
    if set(out) != {*LOGGED, "time_step"}:
        raise SystemExit(f"{path}: not an output of benchmarks/rl_phases.py (found {sorted(out)})")
    return out


def predicted_tiny(key: str, profile: hardware.Profile) -> dict[str, float]:
    _, placement, world, settings = TINY_RUNS[key]
    shape = load_shape(TINY)
    result = step_time.predict(make_plan(placement, world, world), {"actor": shape},
                               step_time.StepSettings(**settings), profile)
    return result["detail"]["as_logged"] | {"time_step": result["total_s"]}


def tiny_table(files: dict[str, list[Path]], profile: hardware.Profile) -> str:
    rows = ["| placement | phase | predicted s | measured s (median; range) | predicted / measured |",
            "|---|---|---|---|---|"]
    for key, paths in files.items():
        if not paths:
            continue
        runs = [measured_phases(p) for p in paths]
        predicted = predicted_tiny(key, profile)
        for phase in (*LOGGED, "time_step"):
            values = [r[phase] for r in runs]
            median = statistics.median(values)
            if median < 1e-3 and predicted[phase] < 1e-3:  # the hybrid hf engine's sync: nothing moves
                verdict = "both under 1 ms"
            else:
                ratio = predicted[phase] / median
                verdict = f"{ratio:.2f}" + ("" if 0.7 <= ratio <= 1.3 else " (miss)")
            rows.append(f"| {TINY_RUNS[key][0]} | {phase.removeprefix('time_')} | {predicted[phase]:.4f} | "
                        f"{median:.4f} ({min(values):.4f}-{max(values):.4f}) | {verdict} |")
    return "\n".join(rows)


def published_table(profile: hardware.Profile) -> str:
    rows = ["| run | predicted s | phases (gen / exchange / scoring / training / sync) | published s | "
            "predicted / published |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for run in PUBLISHED:
            folder = Path(tmp) / re.sub(r"[^a-z0-9]+", "-", run["name"].lower())
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(run["config"]))
            plan = make_plan(run["placement"], run["world"], 8)
            result = step_time.predict(plan, {"actor": load_shape(folder)}, step_time.StepSettings(**run["settings"]),
                                       profile)
            ratio = result["total_s"] / run["measured_s"]
            phases = " / ".join(f"{v:.1f}" for v in result["phases"].values())
            mark = "" if 0.6 <= ratio <= 1.4 else " (miss)"
            rows.append(f"| {run['name']} | {result['total_s']:.1f} | {phases} | {run['measured_s']} | "
                        f"{ratio:.2f}{mark} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key in TINY_RUNS:
        parser.add_argument(f"--{key}", type=Path, nargs="+", default=[],
                            help=f"rl_phases.py output of the {TINY_RUNS[key][0]} run (repeatable)")
    parser.add_argument("--profile", type=Path, default=None, help="a cpu profile file (default: the calibrated one)")
    args = parser.parse_args(argv)
    if any(getattr(args, key) for key in TINY_RUNS):
        if args.profile:
            cpu = hardware.Profile(**json.loads(args.profile.read_text())["profile"])
        else:
            cpu = hardware.load("cpu")
        print(f"cpu profile: {cpu.source}\n")
        print(tiny_table({key: getattr(args, key) for key in TINY_RUNS}, cpu))
        print()
    print(published_table(hardware.load("h100")))
    print(f"\nassumed for the published runs: {ASSUMED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
