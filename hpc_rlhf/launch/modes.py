"""The modes and commands of `hpc-rlhf` and how one runs from its arguments: what the command line (hpc_rlhf.cli)
calls, and what a Slurm task runs in submitit's process (launch/slurm.py), so the launch library never needs the
command line.

Training modes live in `hpc_rlhf/trainers/<mode>.py` (the RL modes in `hpc_rlhf/rl/`); each defines `run(cfg)`
and names its `Config` dataclass, which lives in a module that imports no torch (MODE_CONFIGS: trainers/config.py,
rl/config.py). Other commands (plan, assets, demo, ...) define `main(argv) -> int`. Those modules are imported by
name only when their command runs (importlib), so `hpc-rlhf plan`, `hpc-rlhf MODE --help` and `--dry-run` (on a
login node, or in a Slurm batch step before any rank starts) import neither torch nor transformers: the recipe's
module is imported only to run it. What this module imports itself (the config loader, the local launcher, the dry
run) imports no torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from hpc_rlhf.config import ConfigError, format_help, load_config
from hpc_rlhf.dist.allocation import AllocationError
from hpc_rlhf.launch import dry_run, preflight
from hpc_rlhf.launch.local import run_or_spawn

# mode -> module defining Config and run(cfg)
TRAINING_MODES = {
    "sft": "hpc_rlhf.trainers.sft",
    "kd": "hpc_rlhf.trainers.kd",
    "rm": "hpc_rlhf.trainers.rm",
    "prm": "hpc_rlhf.trainers.prm",
    "dpo": "hpc_rlhf.trainers.dpo",
    "kto": "hpc_rlhf.trainers.kto",
    "ppo": "hpc_rlhf.rl.ppo",
    "grpo": "hpc_rlhf.rl.grpo",
    "generate": "hpc_rlhf.trainers.generate",
    "rs": "hpc_rlhf.trainers.rejection",
    "csft": "hpc_rlhf.trainers.conditional",
    "idpo": "hpc_rlhf.trainers.iterative_dpo",
}
# mode -> its Config class, "module:Class" in a module that imports no torch (the recipe module's `Config` is it)
MODE_CONFIGS = {
    "sft": "hpc_rlhf.trainers.config:SFTConfig",
    "kd": "hpc_rlhf.trainers.config:KDConfig",
    "rm": "hpc_rlhf.trainers.config:RMConfig",
    "prm": "hpc_rlhf.trainers.config:PRMConfig",
    "dpo": "hpc_rlhf.trainers.config:DPOConfig",
    "kto": "hpc_rlhf.trainers.config:KTOConfig",
    "ppo": "hpc_rlhf.rl.config:Config",
    "grpo": "hpc_rlhf.rl.config:GRPOConfig",
    "generate": "hpc_rlhf.trainers.config:GenerateConfig",
    "rs": "hpc_rlhf.trainers.config:RejectionConfig",
    "csft": "hpc_rlhf.trainers.config:ConditionalConfig",
    "idpo": "hpc_rlhf.trainers.config:IterativeDPOConfig",
}
# command -> module defining main(argv) -> int
COMMANDS = {
    "plan": "hpc_rlhf.scale.plan",
    "assets": "hpc_rlhf.data.assets",
    "demo": "hpc_rlhf.demo",
    "submit": "hpc_rlhf.launch.slurm",
    "chat": "hpc_rlhf.chat",
    "merge-lora": "hpc_rlhf.models.merge_lora",
    "serve-rm": "hpc_rlhf.serve_rm",
    "simulate": "hpc_rlhf.scale.simulate",
    "plot": "hpc_rlhf.plot",
    "from-openrlhf": "hpc_rlhf.openrlhf",
    "bandwidth": "hpc_rlhf.dist.bandwidth",
}
DESCRIPTIONS = {
    "sft": "supervised fine-tuning on prompt/response pairs or chats",
    "kd": "knowledge distillation: SFT toward a frozen teacher's next-token distributions",
    "rm": "reward model on chosen/rejected pairs (Bradley-Terry)",
    "prm": "process reward model: a label after each step of a solution",
    "dpo": "direct preference optimisation (sigmoid, IPO, cDPO)",
    "kto": "Kahneman-Tversky optimisation on labelled responses",
    "ppo": "PPO with a critic, on role process groups",
    "grpo": "critic-free RL: GRPO, Dr. GRPO, RLOO, REINFORCE++",
    "generate": "batch generation to JSONL, resumable, optionally scored",
    "rs": "rejection sampling: best-of-n fine-tuning in rounds",
    "csft": "conditional SFT on score-labelled responses (SteerLM style)",
    "idpo": "iterative DPO: generate, score, pair best/worst, DPO, in rounds",
    "chat": "chat with a model folder in the terminal",
    "merge-lora": "merge a LoRA adapter folder into its base: a plain model folder",
    "serve-rm": "serve a reward model over HTTP for runs that score remotely (reward.http_url)",
    "plan": "print the role placement, per-rank memory estimate and (--step-time) one RL step's time",
    "simulate": "run the real set-up of every rank of a large RL job in one process",
    "assets": "generate the built-in tiny tokenizer, model configs and task data",
    "demo": "the built-in pipeline on CPU: SFT -> reward model -> PPO",
    "submit": "queue a training mode on Slurm with submitit (requeued on preemption)",
    "plot": "draw an RL run's reward, KL and held-out accuracy (PNG), with a control run as a line",
    "from-openrlhf": "print the hpc_rlhf config of an OpenRLHF command's flags (ppo, dpo, rm, prm, sft, kd)",
    "bandwidth": "time an all-reduce across the job's ranks (run on every rank): NCCL or gloo bandwidth",
}


def usage() -> str:
    lines = ["usage: hpc-rlhf MODE [--config FILE.yaml] [key=value ...]", "", "modes:"]
    names = list(TRAINING_MODES) + list(COMMANDS)
    width = max(len(name) for name in names)
    for name in names:
        lines.append(f"  {name:<{width}} {DESCRIPTIONS.get(name, '')}")
    lines.append("")
    lines.append("`hpc-rlhf MODE --help` lists every key of a mode with its default.")
    return "\n".join(lines)


def mode_config(mode: str) -> type:
    """The Config dataclass of a training mode, without importing its recipe (nor torch)."""
    module, _, name = MODE_CONFIGS[mode].partition(":")
    return getattr(importlib.import_module(module), name)


def run_training_mode(mode: str, argv: list[str]) -> int:
    config_class = mode_config(mode)
    parser = argparse.ArgumentParser(prog=f"hpc-rlhf {mode}", description=DESCRIPTIONS.get(mode),
                                     add_help=False)
    parser.add_argument("--config", "-c", default=None, help="YAML config file")
    parser.add_argument("--help", "-h", action="store_true")
    dry_run.add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    if args.help:
        print(f"usage: hpc-rlhf {mode} [--config FILE.yaml] [key=value ...]\n"
              f"       hpc-rlhf {mode} --config FILE.yaml --dry-run --world-size N --gpus-per-node G [--model PRESET] "
              f"[--gpu-memory-gb GB] [key=value ...]\n\n{DESCRIPTIONS.get(mode, '')}\n\n"
              f"keys (default, meaning):\n{format_help(config_class)}")
        return 0
    dry_only = [flag for flag, given in (("--world-size", args.world_size is not None),
                                         ("--gpus-per-node", args.gpus_per_node is not None),
                                         ("--model", args.model is not None), ("--json", args.json)) if given]
    if dry_only and not args.dry_run:
        print(f"hpc-rlhf {mode}: {dry_only[0]} is a flag of the dry run; add --dry-run (a run takes its world from "
              f"the launcher)", file=sys.stderr)
        return 2
    bad_flags = [o for o in overrides if o.startswith("-")]
    if bad_flags:
        print(f"hpc-rlhf {mode}: unknown option {bad_flags[0]} (settings are given as key=value; "
              f"see hpc-rlhf {mode} --help)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config_class, args.config, overrides)
    except ConfigError as exc:
        if not args.dry_run:
            print(f"hpc-rlhf {mode}: {exc}", file=sys.stderr)
            return 2
        # A dry run refuses in one line; what shows why (a placement's table) goes to stdout.
        first, _, detail = str(exc).partition("\n")
        print(f"hpc-rlhf {mode} --dry-run: {first}", file=sys.stderr)
        if detail:
            print(detail)
        return 2
    if args.dry_run:
        return dry_run.main(mode, cfg, args)
    if getattr(cfg, "output_dir", None):
        try:
            preflight.check_output_dir_writable(cfg.output_dir)
        except AllocationError as exc:
            print(f"hpc-rlhf {mode}: {exc}", file=sys.stderr)
            return 2
    return run_or_spawn(mode, cfg, importlib.import_module(TRAINING_MODES[mode]).run, argv)


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    mode, rest = argv[0], argv[1:]
    if mode in TRAINING_MODES:
        return run_training_mode(mode, rest)
    if mode in COMMANDS:
        return int(importlib.import_module(COMMANDS[mode]).main(rest) or 0)
    near = difflib.get_close_matches(mode, list(TRAINING_MODES) + list(COMMANDS), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    print(f"hpc-rlhf: unknown mode '{mode}'{hint}\n\n{usage()}", file=sys.stderr)
    return 2
