"""A run's data set-up (every rank does it at start), two ways side by side in one process:

1. row by row    the dataset read one row at a time and each row built alone (`sft_example` /
                 `preference_example` / `prompt_example`: one tokenizer call per text, as the loaders did before
                 2026-11-28)
2. many per call the columns read as lists and the texts tokenised `ENCODE_BATCH_TEXTS` per call (`sft_examples`,
                 `preference_examples`, `prompt_examples`: what the loaders do now)

on the tiny task's files (SFT demonstrations, preference pairs, RL prompts), the first `--rows` rows of each, with the
built-in character tokenizer. Both ways must give the same examples (checked); CPU seconds are medians over
`--repeats` turns of `time.process_time`, after one load of each file (datasets' first call sets itself up).

    .venv/bin/python benchmarks/data_setup.py                       # 9,500 rows a file
    .venv/bin/python benchmarks/data_setup.py --rows 64 --repeats 1 # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

REPO = Path(__file__).resolve().parents[1]
MAX_LEN, MAX_PROMPT_LEN = 64, 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=9500, help="rows of each file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from hpc_rlhf.config import TINY_ASSETS
    from hpc_rlhf.data.assets import ensure_assets
    from hpc_rlhf.data.examples import (preference_example, preference_examples, prompt_example, prompt_examples,
                                        sft_example, sft_examples)
    from hpc_rlhf.data.loading import load_rows
    from hpc_rlhf.models.builders import load_tokenizer

    assets = REPO / TINY_ASSETS
    ensure_assets(assets)
    tokenizer = load_tokenizer(str(assets / "models" / "llama-tiny"))
    limits = dict(max_len=MAX_LEN, max_prompt_len=MAX_PROMPT_LEN)
    cases = {
        "sft": ("sft_train.jsonl",
                lambda rows: [sft_example(tokenizer, prompt=r["prompt"], response=r["response"], where=r["_source"],
                                          **limits) for r in rows],
                lambda c: sft_examples(tokenizer, c["prompt"], c["response"], wheres=c["_source"], **limits)),
        "pairs": ("pref_train.jsonl",
                  lambda rows: [preference_example(tokenizer, prompt=r["prompt"], chosen=r["chosen"],
                                                   rejected=r["rejected"], where=r["_source"], **limits)
                                for r in rows],
                  lambda c: preference_examples(tokenizer, c["prompt"], c["chosen"], c["rejected"],
                                                wheres=c["_source"], **limits)),
        "rl prompts": ("prompts_train.jsonl",
                       lambda rows: [prompt_example(tokenizer, prompt=r["prompt"], max_prompt_len=MAX_PROMPT_LEN,
                                                    where=r["_source"]) for r in rows],
                       lambda c: prompt_examples(tokenizer, c["prompt"], max_prompt_len=MAX_PROMPT_LEN,
                                                 wheres=c["_source"])),
    }
    benchlib.header(f"data set-up of the tiny task's files, {args.rows} rows each, CPU seconds (median of "
                    f"{args.repeats})")
    rows_out = []
    for name, (file, one_by_one, many) in cases.items():
        rows, _ = load_rows([str(assets / "data" / file)], required={}, max_rows=args.rows)
        timings = {"row": [], "many": []}
        for _ in range(args.repeats):
            start = time.process_time()
            slow = one_by_one(iter(rows))  # a datasets.Dataset converts each row as it is read
            timings["row"].append(time.process_time() - start)
            start = time.process_time()
            fast = many(rows.to_dict())
            timings["many"].append(time.process_time() - start)
            if slow != fast:
                raise SystemExit(f"{name}: the two ways gave different examples")
        row, batch = benchlib.median(timings["row"]), benchlib.median(timings["many"])
        rows_out.append([name, row, batch, f"{benchlib.ratio(row, batch):.1f}x"])
    print(benchlib.table(["file", "row by row (s)", "many per call (s)", "ratio"], rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
