"""`hpc-rlhf plan`: the role placement, each role's GPU memory per rank (its NCCL communicators' buffers included),
and with `--step-time` one RL step's time by phase on a hardware profile; `hpc-rlhf plan --calibrate` measures
this machine into the `cpu` profile. Imports no torch (login nodes), except `--calibrate`.

    hpc-rlhf plan --world-size 32 --gpus-per-node 8 --model 70b \\
        --placement actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4 --step-time --hardware h100 [--json]
    hpc-rlhf plan --calibrate [--profile PATH]

The placement and memory table is hpc_rlhf.dist.plan_cli's; this command checks its input first
(hpc_rlhf.scale.job, the check `hpc-rlhf simulate` runs too), adds the communicators (scale/communicators.py)
and the step time (scale/step_time.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from hpc_rlhf.dist import plan_cli
from hpc_rlhf.dist.allocation import public, refusal
from hpc_rlhf.dist.placement import format_rows
from hpc_rlhf.scale import communicators, hardware, step_time
from hpc_rlhf.scale.job import JobInputError, check_job, load_model, refuse

PROG = "hpc-rlhf plan"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, parents=[plan_cli.build_parser()], conflict_handler="resolve",
                                     description=plan_cli.build_parser().description,
                                     epilog="hpc-rlhf plan --calibrate [--profile PATH] measures this machine into "
                                            "the `cpu` hardware profile")
    defaults = step_time.StepSettings()
    parser.add_argument("--step-time", action="store_true", help="predict one RL step's time by phase")
    parser.add_argument("--hardware", default=None, help=f"profile: {', '.join(hardware.NAMES)} (cpu: measured by "
                                                         "--calibrate)")
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="step time: prompts per RL step")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="step time: responses per prompt")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len, help="step time: prompt tokens")
    parser.add_argument("--response-len", type=int, default=defaults.response_len,
                        help="step time: new tokens per response (the mean when known, else the maximum)")
    parser.add_argument("--max-response-len", type=int, default=None,
                        help="step time: the longest response (decode steps per wave; default --response-len)")
    parser.add_argument("--ppo-epochs", type=int, default=defaults.ppo_epochs, help="step time: passes per step")
    parser.add_argument("--train-batch", type=int, default=None,
                        help="step time: samples per optimizer step (default: the whole step)")
    parser.add_argument("--max-staleness", type=int, default=0, help="step time: rl.max_staleness K")
    parser.add_argument("--bucket-mb", type=float, default=defaults.bucket_mb, help="weight sync bucket size (MB)")
    parser.add_argument("--rollout-backend", choices=("vllm", "hf"), default="vllm",
                        help="step time: hybrid engines (rollout@actor): vllm loads the weights, hf uses the actor")
    return parser


def settings_of(args: argparse.Namespace) -> step_time.StepSettings:
    for flag, value in (("--prompts", args.prompts), ("--samples", args.samples), ("--prompt-len", args.prompt_len),
                        ("--response-len", args.response_len), ("--ppo-epochs", args.ppo_epochs),
                        ("--bucket-mb", args.bucket_mb)):
        if value <= 0:
            raise JobInputError(flag, f"must be positive, got {value}")
    if args.max_response_len is not None and args.max_response_len < args.response_len:
        raise JobInputError("--max-response-len", f"is the longest response: at least --response-len "
                                                  f"({args.response_len}), got {args.max_response_len}")
    if args.max_staleness < 0:
        raise JobInputError("--max-staleness", f"must be at least 0, got {args.max_staleness}")
    return step_time.StepSettings(
        prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len, response_len=args.response_len,
        max_response_len=args.max_response_len,
        ppo_epochs=args.ppo_epochs, train_batch=args.train_batch, micro_batch_size=args.micro_batch_size,
        micro_batch_tokens=args.micro_batch_tokens,
        zero_stage=args.zero_stage, gradient_checkpointing=not args.no_gradient_checkpointing,
        bucket_mb=args.bucket_mb, max_staleness=args.max_staleness, rollout_seqs=args.rollout_seqs,
        rollout_backend=args.rollout_backend)


def compute(args: argparse.Namespace) -> dict:
    """The plan, its memory (communicators included) and, with --step-time, the step's time: what --json prints."""
    if args.step_time and args.hardware is None:
        raise JobInputError("--step-time", "needs --hardware (one of: " + ", ".join(hardware.NAMES) + ")")
    job = check_job(args.world_size, args.gpus_per_node, args.placement, args.model, args.hardware)
    settings = settings_of(args) if args.step_time else None
    shapes = {"actor": job.shape,
              "critic": load_model(args.critic_model, "--critic-model") if args.critic_model else job.shape,
              "reward": load_model(args.reward_model, "--reward-model") if args.reward_model else job.shape}
    result = plan_cli.compute(args, extra_gb_of=lambda plan: communicators.buffers_gb(plan, args.zero_stage))
    result = communicators.annotate(result, job.plan, args.zero_stage)
    if settings is not None:
        try:
            result["step_time"] = step_time.predict(job.plan, shapes, settings, job.profile)
        except step_time.StepTimeError as exc:
            raise JobInputError("--placement" if "placement" in str(exc) or "rollout" in str(exc)
                                else "--max-staleness", str(exc)) from None
    return result


def format_step_time(prediction: dict) -> str:
    exchanges = prediction["detail"].get("sequence_exchange_s", {})
    rows = []
    for name, seconds in prediction["phases"].items():
        rows.append((name, f"{seconds:.3f}"))
        if exchanges.get(name):  # what the sequence blocks' all-to-alls take of the phase above
            rows.append(("  of which sequence_exchange", f"{exchanges[name]:.3f}"))
    path = " -> ".join(f"{name} {seconds:.3f}" for name, seconds in prediction["critical_path"])
    s = prediction["settings"]
    return (f"one RL step on {prediction['hardware']} ({s['prompts']} prompts x {s['samples']} samples, "
            f"{s['prompt_len']} + {s['response_len']} tokens, K={s['max_staleness']}):\n"
            f"{format_rows(('phase', 'seconds'), rows)}\ncritical path: {path}\n"
            f"step: {prediction['total_s']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--calibrate" in argv:
        from hpc_rlhf.scale import calibrate  # measures with torch: only this path imports it

        return calibrate.main([a for a in argv if a != "--calibrate"])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message; keep `main` returning an exit code
        return int(exc.code or 0)
    if args.lora_rank < 0:
        return refuse(PROG, JobInputError("--lora-rank", f"must be at least 0 (0: full fine-tuning), got "
                                                         f"{args.lora_rank}"))
    for flag, value in (("--rollout-seqs", args.rollout_seqs), ("--seq-len", args.seq_len),
                        ("--micro-batch-size", args.micro_batch_size)):
        if value < 1:
            return refuse(PROG, JobInputError(flag, f"must be at least 1, got {value}"))
    if args.micro_batch_tokens < 0:
        return refuse(PROG, JobInputError("--micro-batch-tokens", f"must be at least 0 (0: passes of "
                                                                  f"--micro-batch-size sequences), got "
                                                                  f"{args.micro_batch_tokens}"))
    try:
        result = compute(args)
    except JobInputError as exc:
        return refuse(PROG, exc)
    reason = refusal(result)  # a plan that does not fit is refused too, after it is shown
    if args.json:
        print(json.dumps(public(result)))
    else:
        print(_text(result))
    if reason is not None:
        print(f"{PROG}: {reason}", file=sys.stderr)
        return 2
    return 0


def _text(result: dict) -> str:
    table, _, verdict = plan_cli.format_report(result).rpartition("\n\n")
    text = (f"{table}\n\nNCCL communicators: at most {result['max_groups_per_rank']} on a rank "
            f"({result['nccl_communicator_gb']} GB each, counted in GB/rank)\n\n{verdict}")
    if "step_time" in result:
        text += "\n\n" + format_step_time(result["step_time"])
    return text
