"""What every benchmark here shares: the one-thread environment, the benchmark model, timing and tables.

Import this module and call `single_thread_env()` BEFORE importing torch: the thread count of torch's CPU
kernels is fixed when torch is imported, and on a loaded 2-core machine two threads per process made tiny
models up to 100x slower (DESIGN §11). Both sides of every comparison run under the same settings.

Benchmarks never assert times. They print medians of repeated, interleaved measurements and the ratios
between them; a ratio measured in one session on the same load is the figure worth keeping.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
TINY_ASSETS = REPO / "examples" / "tiny" / "assets"
DATA = TINY_ASSETS / "data"

# The benchmark model of DESIGN §11: a Llama of hidden size 128 and 2 layers on the shipped character
# tokenizer (vocabulary 104). MHA with a 2x MLP gives 355K parameters.
BENCH_MODEL_OVERRIDES = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
                         "num_attention_heads": 4, "num_key_value_heads": 4}

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
              "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}


def single_thread_env(cpu: bool = True) -> None:
    """One compute thread, offline Hugging Face, the repository importable. Call before importing torch."""
    for key, value in ONE_THREAD.items():
        os.environ[key] = value
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for benchmark subprocesses: one thread each, no launcher variables inherited."""
    env = dict(os.environ)
    env.update(ONE_THREAD)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "PMI_RANK", "PMI_SIZE"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def set_torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


def ensure_assets() -> Path:
    """The built-in data and tokenizer (generated when missing, as every mode does)."""
    from hpc_rlhf.data.assets import ensure_assets as ensure, is_up_to_date

    if not is_up_to_date(TINY_ASSETS):
        ensure(TINY_ASSETS)
    return TINY_ASSETS


def make_bench_model(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """A seeded random-init Hugging Face folder of the benchmark Llama (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models import tiny

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    config = tiny.model_config("llama-tiny")
    for key, value in {**BENCH_MODEL_OVERRIDES, **overrides}.items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny.copy_tokenizer(out_dir)
    return out_dir


def on_each_rl_step(record) -> None:
    """Call `record()` at the end of every RL step on this rank (inside a benchmark's worker process): every rank
    advances its metrics logger once per step, at its end."""
    from hpc_rlhf.utils import metrics

    advance = metrics.MetricsLogger.advance

    def advance_and_record(self, n: int = 1) -> None:
        record()
        advance(self, n)

    metrics.MetricsLogger.advance = advance_and_record


def run_ppo_then(write, ppo_args: list[str]) -> int:
    """Run the PPO mode through the CLI on this rank, then `write()` this rank's figures."""
    from hpc_rlhf import cli
    from hpc_rlhf.rl import ppo

    run_ppo = ppo.run

    def run_and_write(cfg, mode: str = "ppo"):
        result = run_ppo(cfg, mode)
        write()
        return result

    ppo.run = run_and_write  # the CLI looks the mode's run function up when it starts it
    return cli.main(["ppo", *ppo_args])


def random_actor_and_value(folder: Path) -> tuple[Path, Path]:
    """Random-init actor (llama-tiny) and a value-model folder (the same body, new scalar head), for the RL
    benchmarks whose timings do not depend on what the weights have learnt."""
    from hpc_rlhf.config import ModelSection
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.models.tiny import make_model_folder
    from hpc_rlhf.models.value_model import build_value_model, save_value_model

    actor = make_model_folder("llama-tiny", folder / "actor-random", seed=0)
    value = folder / "value-random"
    model = build_value_model(ModelSection(path=str(actor), dtype="float32"), for_training=False)
    save_value_model(model, value, tokenizer=load_tokenizer(actor))
    return actor, value


# The length-varied task (issue 37): sums of a log-normal number of terms (2 to 24), so prompts run from 6 tokens to
# about 72 (median about 12), like the long tail of reasoning and tool prompts; with a random model the responses
# end at its first end-of-sequence token or at rollout.max_new_tokens, a long tail of their own. Within the 128
# positions of the benchmark models.
LONG_TAILED = {"data.max_prompt_len": 80, "data.max_len": 128, "rollout.max_new_tokens": 48}


def write_long_tailed_prompts(path: Path, rows: int, seed: int = 0) -> Path:
    """`rows` prompt/answer rows of the length-varied task, as JSON lines (the same for the same seed)."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            terms = [rng.randint(1, 99) for _ in range(max(2, min(24, round(rng.lognormvariate(1.3, 0.7)))))]
            f.write(json.dumps({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))}) + "\n")
    return path


def long_tailed_settings(prompts: Path) -> list[str]:
    """The run settings of the length-varied task (its prompt file, lengths and response limit)."""
    return [f"data.train_files=[{prompts}]", *(f"{key}={value}" for key, value in LONG_TAILED.items())]


def add_task_arguments(parser) -> None:
    """The options of the comparisons against TRL that choose hpc_rlhf's runs: --task, --set, --alternate."""
    parser.add_argument("--task", choices=("tiny", "long-tailed"), default="tiny",
                        help="the prompts: the tiny addition task, or the length-varied one")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of hpc_rlhf's runs, e.g. rl.padding_free=true (repeatable)")
    parser.add_argument("--alternate", action="append", default=[], metavar="KEY=VALUE",
                        help="run each hpc_rlhf layout without and with these settings in every round (repeatable: "
                             "all of them together)")


def alternated_sides(layouts: Sequence[str], alternate: Sequence[str]) -> tuple[str, dict[str, tuple[str, list[str]]]]:
    """hpc_rlhf's sides of a comparison: (the name added to a side run with the --alternate settings, "" without
    them; side -> (its layout, its settings)), each layout without, then with, those settings."""
    name = ("+" + " ".join(alternate)) if alternate else ""
    variants = {"": [], **({name: list(alternate)} if alternate else {})}
    return name, {f"hpc_rlhf {layout}{(' ' + suffix) if suffix else ''}": (layout, settings)
                  for layout in layouts for suffix, settings in variants.items()}


def count_params(folder: str | Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            numel = 1
            for s in f.get_slice(name).get_shape():
                numel *= s
            total += numel
    return total


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ timing
class StepClock:
    """Timestamps at the end of each training step; the steady rate skips the first `warmup` steps."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def tick(self) -> None:
        self.stamps.append(time.perf_counter())

    def steady(self, warmup: int) -> tuple[int, float]:
        """(steps, seconds) from the end of step `warmup` to the end of the last step (warmup >= 1: the first
        step's start is not stamped, and it pays one-time costs anyway)."""
        if warmup < 1 or len(self.stamps) <= warmup:
            raise RuntimeError(f"{len(self.stamps)} steps timed; need warmup >= 1 and more steps than "
                               f"warmup={warmup}")
        return len(self.stamps) - warmup, self.stamps[-1] - self.stamps[warmup - 1]


class Lockstep:
    """Two training loops in one process taking turns, one optimizer step each, in two threads.

    Neither loop runs while the other does, so each step is timed on its own, and the two sides' steps are
    interleaved finely enough to see the same load from whatever else runs on the machine: the fairest
    side-by-side measurement a busy shared machine allows. Each loop calls `begin(name)` before its first
    step and `step_done(name)` at the end of every step; `run` calls `finish(name)` when a loop returns.
    `durations[name]` holds each step's time from getting the turn to the end of the step.
    """

    def __init__(self, first: str, second: str):
        self.names = (first, second)
        self._go = {name: threading.Event() for name in self.names}
        self._finished = {name: False for name in self.names}
        self._lock = threading.Lock()
        self._resumed: dict[str, float] = {}
        self.durations: dict[str, list[float]] = {name: [] for name in self.names}
        self._go[first].set()

    def _other(self, name: str) -> str:
        return self.names[1] if name == self.names[0] else self.names[0]

    def begin(self, name: str) -> None:
        self._go[name].wait()
        self._resumed[name] = time.perf_counter()

    def step_done(self, name: str) -> None:
        self.durations[name].append(time.perf_counter() - self._resumed[name])
        other = self._other(name)
        with self._lock:
            if not self._finished[other]:
                self._go[name].clear()
                self._go[other].set()
        self._go[name].wait()
        self._resumed[name] = time.perf_counter()

    def finish(self, name: str) -> None:
        with self._lock:
            self._finished[name] = True
            self._go[self._other(name)].set()  # the other loop runs on alone

    def run(self, loops: dict[str, Any]) -> None:
        """Run `loops[name]()` for both names in their own threads until both return; re-raise a failure."""
        errors: list[BaseException] = []

        def body(name: str) -> None:
            try:
                loops[name]()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors.append(exc)
            finally:
                self.finish(name)

        threads = [threading.Thread(target=body, args=(name,), name=f"lockstep-{name}") for name in self.names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


def rl_step_times_from_metrics(metrics: list[dict], warmup: int) -> list[float]:
    """Wall time of each RL step after `warmup`, from the `time` of consecutive metrics.jsonl rows (a run logged
    with log.every_steps=1). Medians of these resist the load spikes of a shared machine better than one
    whole-window average."""
    rows = sorted((r for r in metrics if "time_step" in r), key=lambda r: r["step"])
    if warmup < 1 or len(rows) <= warmup:
        raise RuntimeError(f"{len(rows)} RL steps logged; need warmup >= 1 and more steps than warmup={warmup}")
    return [rows[i]["time"] - rows[i - 1]["time"] for i in range(warmup, len(rows))]


def grouped_step_times(stamps: Sequence[float], per_group: int, warmup_groups: int) -> list[float]:
    """Durations of groups of `per_group` consecutive steps (e.g. the optimizer steps of one generation round),
    from step-end timestamps, after the first `warmup_groups` groups."""
    ends = list(stamps[per_group - 1::per_group])
    if warmup_groups < 1 or len(ends) <= warmup_groups:
        raise RuntimeError(f"{len(ends)} step groups timed; need warmup >= 1 and more than warmup={warmup_groups}")
    return [ends[i] - ends[i - 1] for i in range(warmup_groups, len(ends))]


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(first, third) quartile: the middle half of the repeats, less sensitive to load spikes than min-max."""
    values = [v for v in values if v == v]
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def spread(values: Sequence[float]) -> str:
    """min-max of the repeats, to show how noisy the machine was."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{min(values):.4g}-{max(values):.4g}"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v):
        if isinstance(v, float):
            if v != v:
                return "n/a"
            return f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in text)]) for i, h in enumerate(headers)]  # rows may be none
    line = "  ".join(f"{h:<{w}}" for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) for r in text]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ machine
def machine_state() -> str:
    """One line on how busy the machine is: the benchmarks share it with other work."""
    load1, load5, _ = os.getloadavg()
    busy = _busy_processes()
    return (f"{os.cpu_count()} CPU cores, load average {load1:.1f} (1 min) / {load5:.1f} (5 min), "
            f"{busy} runnable processes besides this one")


def _busy_processes() -> int:
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        return max(0, running - 1)
    except (OSError, ValueError, IndexError):
        return -1


def versions() -> str:
    import importlib.metadata as md

    out = []
    for name in ("torch", "transformers", "deepspeed", "trl", "accelerate", "datasets"):
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def header(title: str) -> None:
    print(f"== {title}")
    print(f"   {versions()}")
    print(f"   machine: {machine_state()}")
    sys.stdout.flush()


def run_command(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600,
                cwd: str | Path = REPO, what: str = "") -> subprocess.CompletedProcess:
    """Run a benchmark subprocess; on failure show its output tail and stop (a benchmark that failed has no
    figure to print)."""
    proc = subprocess.run(list(cmd), cwd=cwd, env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(f"{what or cmd[0]} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n"
                         f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}\n")
        raise SystemExit(1)
    return proc


# ------------------------------------------------------------------------------------------------ hpc_rlhf
def init_one_rank_world() -> None:
    """hpc_rlhf's training engine needs a torch.distributed world; in-process benchmarks use one of one rank."""
    from hpc_rlhf.dist.bootstrap import init_distributed

    init_distributed("gloo")


def prepare_recipe(recipe_class, config_class, overrides: Sequence[str], on_step_end):
    """Set up an hpc_rlhf recipe (in this process) whose `train()` calls `on_step_end()` after every optimizer
    step: the recipes call `logger.advance()` exactly there, so set-up, the final checkpoint and the final
    save stay outside the steps."""
    import logging

    from hpc_rlhf.config import load_config

    recipe = recipe_class(load_config(config_class, None, list(overrides)))
    recipe.setup()
    logging.getLogger("hpc_rlhf").setLevel(logging.WARNING)
    advance = recipe.run.logger.advance

    def advance_and_report(n: int = 1) -> None:
        on_step_end()
        advance(n)

    recipe.run.logger.advance = advance_and_report
    return recipe


def quiet_run_overrides(output_dir: str | Path, total_steps: int) -> list[str]:
    """No evaluation, TensorBoard, progress bar or resume: only the training steps are of interest."""
    return [f"output_dir={output_dir}", f"train.max_steps={total_steps}", f"log.every_steps={total_steps}",
            "log.eval_every_steps=0", "log.tensorboard=false", "log.progress=false", "checkpoint.resume=false",
            "data.eval_files=[]", "eval.prompt_files=[]"]


def no_recomputation(config_class) -> dict[str, bool]:
    """The keyword that turns activation recomputation off in a TRL config: transformers' TrainingArguments (which
    TRL's configs extend) names it `gradient_checkpointing`, and `activation_checkpointing` in later releases than
    the 5.19 that vLLM's CPU build pins; whichever `config_class` has."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    key = next((k for k in ("gradient_checkpointing", "activation_checkpointing") if k in names), None)
    if key is None:
        raise RuntimeError(f"{config_class.__name__} has neither gradient_checkpointing nor activation_checkpointing")
    return {key: False}


def ranks_command(nproc: int, script: str | Path, args: Sequence[str]) -> list[str]:
    """The torchrun command that runs `script args` as every rank of a local `nproc`-rank world, each rank a fresh
    interpreter (what the figures are measured with)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--max_restarts=0", str(script), *args]


# What a rank of these benchmarks imports: torch, transformers, deepspeed, datasets (import_what_ranks_use), the CLI
# and the RL modes. A fresh interpreter spends ~7 CPU-seconds on them, most of a smoke run's rank.
RANK_IMPORTS = ("hpc_rlhf.cli", "hpc_rlhf.rl.grpo", "hpc_rlhf.rl.ppo", "hpc_rlhf.dist.weight_sync",
                "hpc_rlhf.engines.rollout.hf", "hpc_rlhf.models.lora")


def run_ranks(nproc: int, script: str | Path, args: Sequence[str], launcher: str, main, *,
              env: dict[str, str] | None = None, what: str = "", timeout: float = 1800) -> None:
    """Run `script args` as every rank of a local `nproc`-rank world (torchrun's variables) and wait; on failure
    show the ranks' output tail and stop, as `run_command`.

    `torchrun`: a fresh interpreter per rank (what the figures are measured with). `local` (the smoke runs):
    every rank is a fork of THIS process, which imports what the ranks use once (`RANK_IMPORTS`) before it forks
    them (hpc_rlhf's own local launcher, `spawn_local`); each rank calls `main(args)` (the script's entry point,
    which dispatches to its worker) with its output in a file of its own. No interpreter starts at all: a
    quarter of the CPU time of the same smoke run through `python script` and the CLI's local launcher. Nothing
    measured survives it (a forked rank's memory starts as the driver's; `env`'s malloc settings take effect at
    an interpreter's start only): smoke runs only. The worker installs its instrumentation in the rank, as under
    torchrun. `timeout` bounds the torchrun command; forked ranks die with this process (spawn_local's parent-death
    signal), which the smoke test's own timeout bounds."""
    env = child_env() if env is None else env
    if launcher == "torchrun":
        run_command(ranks_command(nproc, script, args), env=env, what=what, timeout=timeout)
        return
    if launcher != "local":
        raise ValueError(f"launcher must be torchrun or local, not {launcher!r}")
    import importlib
    import tempfile

    from hpc_rlhf.launch.local import import_what_ranks_use, spawn_local

    import_what_ranks_use()
    for name in RANK_IMPORTS:
        importlib.import_module(name)
    set_torch_threads()
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as logs:
        def rank_main() -> int:
            fd = os.open(Path(logs) / f"rank{os.environ['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            return int(main(list(args)) or 0)

        code = spawn_local(nproc, [sys.executable, str(script), *args], env=env, target=rank_main)
        if code != 0:
            tails = "".join(f"--- rank {r}\n{(Path(logs) / f'rank{r}.log').read_text()[-3000:]}\n"
                            for r in range(nproc) if (Path(logs) / f"rank{r}.log").exists())
            sys.stderr.write(f"{what or script} failed (exit {code}), {nproc} forked ranks: {script} "
                             f"{' '.join(map(str, args))}\n{tails}")
            raise SystemExit(1)
