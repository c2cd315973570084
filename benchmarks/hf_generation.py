"""The hf rollout engine's generation (on CPU, or a GPU with `--device cuda`), three ways side by side in one process:

1. lean         HFRolloutEngine's default decode loop: each prompt prefilled once, its KV cache repeated for the n
                samples, one forward, one log-softmax and one draw per step for the batch
2. generate     HFRolloutEngine(decode_loop="generate"): transformers' `generate` with num_return_sequences=n and the
                engine's log-prob processor (the engine's path before the lean loop)
3. trl-style    plain transformers `generate` on the prompts repeated n times, sampling at temperature 1 with no
                truncation and no log-probs: how TRL's GRPOTrainer generates without vLLM (its sampler repeats each
                prompt n times and it calls `generate` on the batch)

on a model of the tiny task (`--model tiny`: the built-in llama-tiny; `--model bench`: the benchmark Llama, 355K
parameters; `--model 1b`: a random Llama of TinyLlama-1.1B's shape, for `--device cuda`), `--prompts` prompts of the
tiny task's training set x `--n` samples, `--new-tokens` tokens at most, seeded. Samples/s = prompts x n / seconds;
tokens/s = generated tokens / seconds. Medians over `--repeats` turns are compared; nothing is asserted.

    .venv/bin/python benchmarks/hf_generation.py                        # n=8, 6 new tokens (the GRPO example's)
    .venv/bin/python benchmarks/hf_generation.py --new-tokens 32        # longer responses
    .venv/bin/python benchmarks/hf_generation.py --prompts 2 --n 2 --new-tokens 2 --repeats 1   # smoke run
    python benchmarks/hf_generation.py --model 1b --device cuda --dtype bfloat16 --prompts 64 --new-tokens 128
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "bench", "1b"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=6, help="max_new_tokens")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    benchlib.set_torch_threads()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rlhf.engines.rollout.base import SamplingParams, cut_at_stop
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

    benchlib.header(f"hf engine generation: lean loop, transformers' generate, TRL-style generate "
                    f"(model {args.model}, {args.prompts} prompts x n={args.n}, {args.new_tokens} new tokens)")
    benchlib.ensure_assets()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "1b":
            from gpu_throughput import PRESETS
            from transformers import LlamaConfig

            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS["1b"], attn_implementation="sdpa"),
                                                     dtype=dtype)
        else:
            folder = benchlib.TINY_ASSETS / "models" / "llama-tiny" if args.model == "tiny" else \
                benchlib.make_bench_model(Path(tmp) / "model")
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        model = model.to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(benchlib.TINY_ASSETS / "tokenizer")
    rows = [json.loads(line) for line in open(benchlib.DATA / "prompts_train.jsonl")][:args.prompts]
    prompt_ids = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    engines = {"lean": HFRolloutEngine(model, pad, eos, decode_loop="lean"),
               "generate": HFRolloutEngine(model, pad, eos, decode_loop="generate")}

    def trl_style(seed: int) -> int:
        repeated = [p for p in prompt_ids for _ in range(args.n)]
        width = max(len(p) for p in repeated)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in repeated], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in repeated], device=args.device)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.new_tokens, pad_token_id=pad, eos_token_id=eos)
        return sum(cut_at_stop(row, [eos], args.new_tokens)[0] for row in out[:, width:].cpu())

    def engine_run(name: str, seed: int) -> int:
        sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=seed)
        return sum(len(r) for r in engines[name].generate(prompt_ids, sampling).flat_responses())

    runs = {"lean": lambda seed: engine_run("lean", seed), "generate": lambda seed: engine_run("generate", seed),
            "trl-style": trl_style}
    times = {name: [] for name in runs}
    tokens = {name: [] for name in runs}
    for name, run in runs.items():  # one untimed call each: first-call allocations and lazy imports
        run(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for repeat in range(args.repeats):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            tokens[name].append(run(1 + repeat))
            sync()
            times[name].append(time.perf_counter() - start)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)

    samples = len(prompt_ids) * args.n
    table = []
    for name in runs:
        seconds = benchlib.median(times[name])
        table.append([name, f"{seconds:.3f}", benchlib.spread(times[name]), f"{samples / seconds:.0f}",
                      f"{benchlib.median(tokens[name]) / seconds:.0f}"])
    print(benchlib.table(["path", "median s", "spread", "samples/s", "tokens/s"], table))
    lean_s = benchlib.median(times["lean"])
    print(f"lean / generate (samples/s): {benchlib.ratio(benchlib.median(times['generate']), lean_s):.2f}x")
    print(f"lean / trl-style (samples/s): {benchlib.ratio(benchlib.median(times['trl-style']), lean_s):.2f}x")
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=12345)
    lean, reference = (engines[name].generate(prompt_ids, sampling).flat_responses() for name in ("lean", "generate"))
    same = sum(torch.equal(a, b) for a, b in zip(lean, reference, strict=True))
    print(f"seeded lean rollout token for token the generate one: {same} of {len(lean)} samples")
    print(benchlib.machine_state())
    return 0


if __name__ == "__main__":
    sys.exit(main())
