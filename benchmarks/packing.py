"""Sample packing: padding efficiency and SFT tokens/s with and without it, on the built-in data.

1. Padding efficiency = real tokens / processed tokens (each batch padded to its longest row), for the SFT
   pairs (sft_train.jsonl) and the two-turn chats (chat_train.jsonl, chat template) at several max_len values.
   Unpacked: batches of `--batch-size` examples in a shuffled order, as training draws them. Packed: the same
   examples packed by `hpc_rlhf.data.packing.pack_examples` (first-fit decreasing) into rows of max_len,
   batches of `--batch-size` rows in a shuffled order. Pure arithmetic on the tokenised data, no model.
2. Real tokens/s of hpc_rlhf's SFT recipe (benchmark Llama, one thread) with data.packing off and on: both
   recipes in one process taking turns step by step (`benchlib.Lockstep`), so both see the same load. A step's
   rate is the real tokens of the examples it trained on / its time; figures are medians over the timed steps,
   the ratio the median over step pairs. Same batch in rows, so a packed step carries several times the
   examples of an unpacked one.

    .venv/bin/python benchmarks/packing.py
    .venv/bin/python benchmarks/packing.py --max-lens 32 64 128 256 --rounds 5 --steps 100
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

DATASETS = {"sft": ("sft_train.jsonl", False), "chat": ("chat_train.jsonl", True)}


def tokenized_examples(dataset: str, max_len: int, rows: int) -> list[dict]:
    """The examples exactly as the SFT recipe makes them (its own loader, tokenizer and truncation)."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.trainers import sft

    file, chat = DATASETS[dataset]
    cfg = load_config(sft.Config, None, [f"data.train_files=[{benchlib.DATA / file}]", f"data.max_len={max_len}",
                                         f"data.max_prompt_len={max_len // 2}",
                                         f"data.apply_chat_template={str(chat).lower()}"])
    tokenizer = load_tokenizer(benchlib.TINY_ASSETS / "tokenizer")
    return sft.load_sft_examples(cfg.data.train_files, cfg, tokenizer, "data.train_files", rows)


def efficiency(rows: list[dict], batch_size: int, seed: int = 0) -> float:
    from hpc_rlhf.data.packing import padding_efficiency

    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    return padding_efficiency(shuffled, batch_size)


def efficiency_table(datasets: list[str], max_lens: list[int], batch_size: int, rows: int) -> None:
    from hpc_rlhf.data.packing import pack_examples

    table_rows = []
    for dataset in datasets:
        for max_len in max_lens:
            examples = tokenized_examples(dataset, max_len, rows)
            lengths = [len(e["input_ids"]) for e in examples]
            packed = pack_examples(examples, max_len)
            plain, dense = efficiency(examples, batch_size), efficiency(packed, batch_size)
            table_rows.append([dataset, max_len, f"{min(lengths)}-{max(lengths)}", sum(lengths) / len(lengths),
                               len(examples) / len(packed), plain, dense, f"{dense / plain:.2f}x"])
    print(benchlib.table(["data", "max_len", "tokens/example", "mean", "examples/packed row",
                          "efficiency unpacked", "efficiency packed", "packed / unpacked"], table_rows))


def sft_recipe(dataset: str, packing: bool, model_dir: Path, work: Path, max_len: int, batch: int,
               total_steps: int, rows: int, on_step_end):
    """The set-up SFT recipe and the real tokens of each of its optimizer steps (its own pure data order)."""
    from hpc_rlhf.trainers import sft
    from hpc_rlhf.data import order

    file, chat = DATASETS[dataset]
    overrides = benchlib.quiet_run_overrides(work, total_steps) + [
        f"model.path={model_dir}", "model.dtype=float32", "model.attn_implementation=sdpa",
        f"data.train_files=[{benchlib.DATA / file}]", f"data.max_train_rows={rows}", f"data.max_len={max_len}",
        f"data.max_prompt_len={max_len // 2}", f"data.apply_chat_template={str(chat).lower()}",
        f"data.packing={str(packing).lower()}", f"train.batch_size={batch}", f"train.micro_batch_size={batch}"]
    recipe = benchlib.prepare_recipe(sft.SFTRecipe, sft.Config, overrides, on_step_end)
    examples, seed = recipe.train_examples, recipe.cfg.train.seed
    tokens = [sum(len(examples[i]["input_ids"]) for i in order.step_indices(len(examples), batch, step, seed))
              for step in range(total_steps)]
    return recipe, tokens


def measure(dataset: str, model_dir: Path, work: Path, args, first: str) -> dict[str, list[float]]:
    """One lockstep run of the SFT recipe without and with packing: {side: real tokens/s of each timed step}."""
    sides = ("unpacked", "packed")
    lock = benchlib.Lockstep(first, sides[1] if first == sides[0] else sides[0])
    total = args.warmup + args.steps
    recipes, tokens = {}, {}
    for side in sides:
        recipes[side], tokens[side] = sft_recipe(dataset, side == "packed", model_dir, work / side,
                                                 args.throughput_max_len, args.batch_size, total, args.rows,
                                                 lambda side=side: lock.step_done(side))

    def loop(side: str):
        def body() -> None:
            lock.begin(side)
            recipes[side].train()
        return body

    lock.run({side: loop(side) for side in sides})
    return {side: [tokens[side][i] / lock.durations[side][i] for i in range(args.warmup, total)] for side in sides}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--max-lens", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--batch-size", type=int, default=16, help="rows per step (packed rows when packing)")
    parser.add_argument("--rows", type=int, default=2048, help="examples tokenised per data set")
    parser.add_argument("--throughput-max-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="lockstep runs per data set (who starts alternates)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every round")
    parser.add_argument("--no-throughput", action="store_true", help="only the padding-efficiency table")
    args = parser.parse_args(argv)

    benchlib.set_torch_threads()
    benchlib.ensure_assets()
    benchlib.header("Packing: padding efficiency and SFT tokens/s, hpc_rlhf with and without data.packing")
    print(f"   {args.rows} examples per data set, batches of {args.batch_size} rows, shuffled; "
          f"first-fit-decreasing packing\n")
    efficiency_table(args.datasets, args.max_lens, args.batch_size, args.rows)
    if args.no_throughput:
        return 0

    benchlib.init_one_rank_world()
    print(f"\n   SFT throughput at max_len {args.throughput_max_len}, batch {args.batch_size} rows, {args.steps} timed "
          f"steps per side after {args.warmup}, {args.rounds} rounds; packed and unpacked recipes in one process "
          f"taking turns step by step (benchmark Llama, fp32, sdpa, 1 thread)")
    rates: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = benchlib.make_bench_model(Path(tmp) / "bench-llama")
        for r in range(args.rounds):
            for dataset in args.datasets:
                first = ("unpacked", "packed")[r % 2]
                got = measure(dataset, model_dir, Path(tmp) / f"{dataset}-{r}", args, first)
                for side, values in got.items():
                    rates.setdefault((dataset, side), []).extend(values)
                print(f"   round {r + 1} {dataset}: median tokens/s unpacked {benchlib.median(got['unpacked']):,.0f}, "
                      f"packed {benchlib.median(got['packed']):,.0f} ({first} first)", flush=True)
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows = []
    for dataset in args.datasets:
        paired = [p / u for u, p in zip(rates[(dataset, "unpacked")], rates[(dataset, "packed")])]
        for side in ("unpacked", "packed"):
            lo, hi = benchlib.quartiles(rates[(dataset, side)])
            rows.append([dataset, side, benchlib.median(rates[(dataset, side)]), f"{lo:,.0f}-{hi:,.0f}",
                         f"{benchlib.median(paired):.2f}x" if side == "packed" else ""])
    print(benchlib.table(["data", "rows", "real tokens/s (median step)", "IQR", "packed / unpacked (paired)"],
                         rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
