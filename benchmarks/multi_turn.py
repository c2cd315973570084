"""Multi-turn rollout on CPU (hpc_rlhf.envs.run_episodes on the hf engine), three ways side by side in one process:

1. batched      every live episode of a turn in one generate call (what the RL step does)
2. one by one   the same episodes (rows, samples, seeds) played one episode at a time: one generate call per turn
                of each episode
3. single turn  one generate call per batch that samples as many new tokens as the batched episodes' model turns
                did in all (`max_new_tokens` = their most per episode), no environment: what the same generated
                tokens cost without turns, observations and environment calls

on the benchmark Llama (random, 355K parameters) and the guessing game of the tiny task (guess_number: a wrong
guess gets higher/lower and the question again), `--prompts` prompts x `--n` samples, `--turns` turns at most,
temperature 1, seeded. The three take turns, `--repeats` times; medians are compared. Episodes/s = episodes /
seconds; tokens/s = the model's generated tokens / seconds (observations not counted). Nothing is asserted.

    .venv/bin/python benchmarks/multi_turn.py
    .venv/bin/python benchmarks/multi_turn.py --prompts 2 --n 2 --turns 2 --new-tokens 2 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4, help="samples (episodes) per prompt")
    parser.add_argument("--turns", type=int, default=3, help="env.max_turns")
    parser.add_argument("--new-tokens", type=int, default=6, help="rollout.max_new_tokens (per turn)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    benchlib.set_torch_threads()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rlhf.engines.rollout.base import SamplingParams
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
    from hpc_rlhf.envs.config import EnvSection
    from hpc_rlhf.envs.episodes import run_episodes
    from hpc_rlhf.envs.loading import load_environment

    benchlib.header("multi-turn rollout: batched turns, one episode at a time, single turn")
    benchlib.ensure_assets()
    with tempfile.TemporaryDirectory() as tmp:
        folder = benchlib.make_bench_model(Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = HFRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    rows = [json.loads(line) for line in open(benchlib.DATA / "prompts_train.jsonl")][:args.prompts]
    prompt_ids = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    settings = EnvSection(name="guess_number", max_turns=args.turns, max_episode_tokens=args.turns * 40)
    env = load_environment(settings)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)

    def batched(seed: int):
        return run_episodes(rows, prompt_ids, engine.generate, dataclasses.replace(sampling, seed=seed), env=env,
                            tokenizer=tokenizer, settings=settings)

    def one_by_one(seed: int):
        played = []
        for i, (row, ids) in enumerate(zip(rows, prompt_ids)):
            for j in range(args.n):
                one = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new_tokens,
                                     seed=seed * 1000 + i * 10 + j)
                played += run_episodes([row], [ids], engine.generate, one, env=env, tokenizer=tokenizer,
                                       settings=settings).episodes
        return played

    times = {"batched": [], "one by one": [], "single turn": []}
    tokens = {"batched": [], "one by one": [], "single turn": []}
    episodes = len(rows) * args.n
    for repeat in range(args.repeats):
        seed = 1 + repeat
        start = time.perf_counter()
        played = batched(seed)
        times["batched"].append(time.perf_counter() - start)
        model_tokens = [int(e.mask.sum()) for e in played.episodes]
        tokens["batched"].append(sum(model_tokens))
        start = time.perf_counter()
        alone = one_by_one(seed)
        times["one by one"].append(time.perf_counter() - start)
        tokens["one by one"].append(sum(int(e.mask.sum()) for e in alone))
        single = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=max(model_tokens), seed=seed)
        start = time.perf_counter()
        out = engine.generate(prompt_ids, single)
        times["single turn"].append(time.perf_counter() - start)
        tokens["single turn"].append(sum(len(r) for r in out.flat_responses()))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items())
              + f"; turns per episode {played.metrics()['turns_mean']:.2f}, generate calls batched "
              f"{played.generate_calls}", flush=True)

    rows_out = []
    for name in times:
        seconds = benchlib.median(times[name])
        rows_out.append([name, f"{seconds:.2f}", benchlib.spread(times[name]), f"{episodes / seconds:.1f}",
                         f"{benchlib.median(tokens[name]) / seconds:.0f}"])
    print(benchlib.table(["rollout", "median s", "spread", "episodes/s", "model tokens/s"], rows_out))
    batched_s, alone_s = benchlib.median(times["batched"]), benchlib.median(times["one by one"])
    single_s = benchlib.median(times["single turn"])
    print(f"batched / one by one (episodes/s): {benchlib.ratio(alone_s, batched_s):.1f}x")
    multi_rate = benchlib.median(tokens["batched"]) / batched_s
    single_rate = benchlib.median(tokens["single turn"]) / single_s
    print(f"multi-turn / single turn (model tokens/s): {benchlib.ratio(multi_rate, single_rate):.2f}x")
    print(benchlib.machine_state())
    return 0


if __name__ == "__main__":
    sys.exit(main())
