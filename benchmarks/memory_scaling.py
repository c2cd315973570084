"""Peak memory of an actor rank over one full PPO step, with the actor sharded by ZeRO-3 over 1, 2 and 4 ranks.

Each configuration is a fresh torchrun job running `hpc-rlhf ppo` for one RL step: the actor (ZeRO-3 over N
ranks, fp32 on CPU, AdamW), a critic (ZeRO-3, one rank), one hf rollout engine; the rule reward, no reference
(`rl.kl_coef=0`: it would sit on ranks of its own and change nothing on the actor's). The step is all of it:
generation, scoring (the actor's old log-probs through its forward), training (one optimizer step, where AdamW
allocates its states), weight sync (streamed to the engine). The model is a random-init Llama of 59.6M
parameters (hidden 640, MLP 1728, 12 layers, the shipped character tokenizer), persistence threshold 0 so that
every parameter is partitioned.

How peak memory is measured, and why it is the truth:
- What a rank holds is its resident set (RSS): every page of the process that is in memory, whatever allocated
  it (torch tensors, DeepSpeed's flat partitions and buckets, gloo's buffers, Python objects). A thread reads
  /proc/self/statm every 2 ms, and the same reading is taken after every module's forward pass (where
  activations peak) and at every phase change of the step; `getrusage` high-water marks cannot be reset, so
  they would include set-up, which loads the whole model on every rank before DeepSpeed partitions it.
- glibc's malloc keeps freed memory in its heap unless told otherwise, and then RSS would remember set-up's
  whole-model copies. The ranks run with MALLOC_MMAP_THRESHOLD_=65536 and MALLOC_TRIM_THRESHOLD_=0: every block
  larger than 64 KB is its own mapping, returned to the kernel when freed, so RSS follows what is live.
- Baseline: the rank's RSS just before its model is built (interpreter, torch, deepspeed, process groups):
  what the rank costs without a model. Peak: the highest RSS from the start of the step to the end of its
  weight sync. "peak_mb" for N ranks is the highest (peak - baseline) over the N actor ranks.
- Alongside, DeepSpeed's own parameter status gives the most actor parameter bytes gathered whole at once
  during the step (one module, or DeepSpeed's window: engines/train.py).
Peak memory does not depend on the machine's load (unlike time), so one run per configuration is enough.

The table compares each figure with `hpc_rlhf.dist.memory.estimate` (the model behind `hpc-rlhf plan`) for the
same shapes, fp32, micro-batch and sequence length.

    .venv/bin/python benchmarks/memory_scaling.py
    .venv/bin/python benchmarks/memory_scaling.py --ranks 1 2 4 --json      # last line: one JSON object
    .venv/bin/python benchmarks/memory_scaling.py --smoke     # does it run (the suite's smoke run): no figures to keep
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
               "num_key_value_heads": 4}  # --smoke: that the measurement runs, on a model that loads at once
MICRO_BATCH = 4  # per rank and pass, for every rank count: the same activations whatever N
PROMPTS, SAMPLES, NEW_TOKENS = 4, 4, 4
MB = 2**20
# Weight-sync buckets in proportion to the model: the default 256 MB against 140 GB of a 70B model is 0.2%;
# here a 256 MB bucket would hold the whole 238 MB model, so the leader would keep a whole copy in it.
BUCKET_MB = 16
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


# ------------------------------------------------------------------------------------------------ worker
def worker(out: Path, args: list[str]) -> int:
    import torch

    from hpc_rlhf import cli
    from hpc_rlhf.dist import watchdog
    from hpc_rlhf.rl import ppo
    from hpc_rlhf.rl import step as rl_step
    from hpc_rlhf.rl import sync as rl_sync

    page = os.sysconf("SC_PAGE_SIZE")
    state = {"baseline": None, "window": False, "peak": 0, "phases": {}, "gathered": 0, "role": None}

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def sample(*_) -> None:
        if state["window"]:
            now = rss()
            state["peak"] = max(state["peak"], now)
            phase = watchdog.current_phase() or "step"
            state["phases"][phase] = max(state["phases"].get(phase, 0), now)
            state["gathered"] = max(state["gathered"], gathered())

    def sampler() -> None:
        while True:
            sample()
            time.sleep(0.002)

    actor_modules: list = []

    def gathered() -> int:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return sum(p.ds_numel * p.element_size() for m in actor_modules for p in m.parameters()
                   if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE)

    build = rl_step.build_causal_lm

    def build_actor(cfg, *a, **kw):  # the actor (trained): the rank's own baseline before its model exists
        state["baseline"], state["role"] = rss(), "actor"
        return build(cfg, *a, **kw)

    rl_step.build_causal_lm = build_actor
    set_step = watchdog.set_step

    def start_window(step: int) -> None:  # the recipe announces step 1: the window opens
        state["window"] = True
        set_step(step)

    watchdog.set_step = start_window
    sync = rl_sync.WeightSync.sync

    def sync_then_close(self):
        if self.actor is not None and not actor_modules:
            actor_modules.append(self.actor.module)
        result = sync(self)
        sample()
        state["window"] = False
        return result

    rl_sync.WeightSync.sync = sync_then_close
    score = rl_step.RLRecipe._score

    def score_and_watch(self, *a, **kw):  # from scoring on, DeepSpeed's status of the actor's parameters
        if self.actor is not None and not actor_modules:
            actor_modules.append(self.actor.module)
        return score(self, *a, **kw)

    rl_step.RLRecipe._score = score_and_watch
    run = ppo.run

    def measured_run(cfg, *a, **kw):  # in the rank's own process (forked ranks inherit the patches, not threads)
        threading.Thread(target=sampler, daemon=True).start()
        torch.nn.modules.module.register_module_forward_hook(sample)
        result = run(cfg, *a, **kw)
        (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps({
            "role": state["role"], "baseline": state["baseline"], "peak": state["peak"], "phases": state["phases"],
            "gathered": state["gathered"]}))
        return result

    ppo.run = measured_run  # the CLI looks the mode's run function up when it starts it
    return cli.main(args)


# ------------------------------------------------------------------------------------------------ driver
def make_model(folder: Path, shape: dict) -> tuple[Path, int]:
    path = benchlib.make_bench_model(folder / "llama", seed=0, **shape)
    return path, benchlib.count_params(path)


def run_config(ranks: int, model: Path, tmp: Path, launcher: str = "torchrun") -> list[dict]:
    out = tmp / f"actor{ranks}"
    out.mkdir()
    args = ["ppo", "--config", str(benchlib.REPO / "examples/tiny/ppo.yaml"), f"output_dir={out / 'run'}",
            f"placement=actor={ranks},critic=1,rollout=1", f"actor.path={model}", f"critic.path={model}",
            "reward.models=[]", "reward.functions=[exact_match]", "rl.kl_coef=0", "train.max_steps=1",
            "critic_train.max_steps=1", "train.zero_stage=3", "critic_train.zero_stage=3",
            "train.zero3_param_persistence_threshold=0", "critic_train.zero3_param_persistence_threshold=0",
            f"rollout.prompts_per_step={PROMPTS}", f"rollout.n_samples={SAMPLES}",
            f"rollout.max_new_tokens={NEW_TOKENS}", f"train.batch_size={PROMPTS * SAMPLES}",
            f"train.micro_batch_size={MICRO_BATCH}",
            f"critic_train.batch_size={PROMPTS * SAMPLES}", f"critic_train.micro_batch_size={MICRO_BATCH}",
            f"data.train_files=[{benchlib.DATA / 'prompts_train.jsonl'}]", "data.max_train_rows=64",
            f"rollout.weight_sync_bucket_mb={BUCKET_MB}", "data.eval_files=[]", "log.eval_every_steps=0",
            "log.tensorboard=false", "log.progress=false",
            "checkpoint.every_steps=0", "checkpoint.resume=false"]
    benchlib.run_ranks(ranks + 2, Path(__file__).resolve(), ["--worker", str(out), *args], launcher, main,
                       env=benchlib.child_env(MALLOC), what=f"{ranks}-rank actor PPO step", timeout=1200)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks + 2)]


def predicted_mb(params_shape, ranks: int, micro: int, seq_len: int) -> dict[str, float]:
    from hpc_rlhf.dist.memory import GB, estimate

    est = estimate("actor", params_shape, ranks, zero_stage=3, micro_batch_size=micro, seq_len=seq_len,
                   gradient_checkpointing=False, overhead_gb=0.0, dtype_bytes=4, weight_sync_bucket_mb=BUCKET_MB)
    return {k: v * GB / MB for k, v in est.items()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4], help="actor rank counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--smoke", action="store_true",
                        help="that it runs, not a measurement: one actor rank, a 2-layer model of hidden size 64, "
                             "every rank forked from this process (benchlib.run_ranks)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ranks = [1]
    benchlib.ensure_assets()
    benchlib.header(f"Actor peak memory over one PPO step, ZeRO-3 over {', '.join(map(str, args.ranks))} ranks")
    from hpc_rlhf.dist.memory import ModelShape

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, params = make_model(tmp, SMOKE_MODEL if args.smoke else MODEL)
        shape = ModelShape.from_config_json(model / "config.json")
        results = {}
        for ranks in args.ranks:
            started = time.perf_counter()
            reports = run_config(ranks, model, tmp, "local" if args.smoke else "torchrun")
            actors = [r for r in reports if r["role"] == "actor"]
            results[ranks] = {"actors": actors, "seconds": time.perf_counter() - started}
    model_mb = params * 4 / MB
    seq_len = 16 + NEW_TOKENS  # data.max_prompt_len + rollout.max_new_tokens (the longest a sample can be)
    print(f"   model: {params / 1e6:.1f}M parameters, {model_mb:.0f} MB in fp32; {PROMPTS} prompts x {SAMPLES} "
          f"samples, {NEW_TOKENS} new tokens")
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows, peak_mb = [], {}
    for ranks, result in results.items():
        over = [(a["peak"] - a["baseline"]) / MB for a in result["actors"]]
        peak_mb[str(ranks)] = round(max(over), 1)
        predicted = predicted_mb(shape, ranks, MICRO_BATCH, seq_len)
        by_phase = {}
        for actor in result["actors"]:
            for phase, value in actor["phases"].items():
                by_phase[phase] = max(by_phase.get(phase, 0.0), (value - actor["baseline"]) / MB)
        busiest = max(by_phase, key=by_phase.get)
        rows.append([ranks, f"{min(a['baseline'] for a in result['actors']) / MB:.0f}", f"{max(over):.0f}",
                     f"{max(over) / peak_mb[str(min(results))]:.2f}", busiest,
                     f"{max(a['gathered'] for a in result['actors']) / MB:.1f}",
                     f"{predicted['total']:.0f}", f"{max(over) / predicted['total']:.2f}",
                     f"{result['seconds']:.0f}"])
    print(benchlib.table(["actor ranks", "baseline MB", "peak - baseline MB", "vs fewest ranks", "at phase",
                          "gathered at once MB", "plan predicts MB", "measured / plan", "run s"], rows))
    print("\n   'gathered at once': the most actor parameter bytes DeepSpeed held whole on a rank during the step")
    if args.json:
        print(json.dumps({"params": params, "peak_mb": peak_mb, "model_mb": round(model_mb, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
