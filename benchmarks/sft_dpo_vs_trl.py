"""SFT and DPO training throughput: hpc_rlhf's recipes against TRL's SFTTrainer and DPOTrainer.

Same model (the 355K-parameter benchmark Llama, random init, fp32, sdpa, no gradient checkpointing), same data
(the built-in addition task: sft_train.jsonl, pref_train.jsonl), same batch (16 sequences or pairs, one
optimizer step each), same optimizer settings (AdamW, betas 0.9/0.95, clip 1.0), one thread. DPO on both sides
runs the sigmoid loss (beta 0.1) with a frozen reference model that scores every batch (no precomputation).

Both trainers live in this one process and take turns step by step (`benchlib.Lockstep`): hpc_rlhf step 1,
TRL step 1, hpc_rlhf step 2, ... so each step is timed alone while both sides see the same load from the rest
of the machine. Steps/s = 1 / median step time after the warmup steps; the ratio is the median over step
pairs of TRL's step time / hpc_rlhf's (above 1: hpc_rlhf faster). Who starts alternates between rounds.
Tokens/s counts real tokens (no padding): steps/s x batch x the mean tokens per row of that side's own
tokenisation (tok/row; a DPO row is a pair, both sequences counted).

    .venv/bin/python benchmarks/sft_dpo_vs_trl.py                 # default: 2 rounds of 100 timed steps
    .venv/bin/python benchmarks/sft_dpo_vs_trl.py --modes sft --rounds 4 --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

benchlib.single_thread_env()

LR = 1e-3
WARMUP_LR_STEPS = 10
MAX_LEN = 64
SIDES = ("hpc_rlhf", "trl")


# ------------------------------------------------------------------------------------------- hpc_rlhf side
def hpc_recipe(mode: str, model_dir: Path, work: Path, batch: int, total_steps: int, rows: int, on_step_end):
    """The set-up SFT or DPO recipe and the tokens of each of its training rows."""
    if mode == "sft":
        from hpc_rlhf.trainers import sft as module

        recipe_class, data = module.SFTRecipe, "sft_train.jsonl"
    else:
        from hpc_rlhf.trainers import dpo as module

        recipe_class, data = module.DPORecipe, "pref_train.jsonl"
    overrides = benchlib.quiet_run_overrides(work, total_steps) + [
        f"model.path={model_dir}", "model.dtype=float32", "model.attn_implementation=sdpa",
        f"data.train_files=[{benchlib.DATA / data}]", f"data.max_train_rows={rows}", f"data.max_len={MAX_LEN}",
        f"train.batch_size={batch}", f"train.micro_batch_size={batch}", f"train.lr={LR}",
        f"train.warmup_steps={WARMUP_LR_STEPS}", "train.adam_beta2=0.95", "train.max_grad_norm=1.0"]
    if mode == "dpo":
        overrides += ["dpo.loss_type=sigmoid", "dpo.beta=0.1", "ref.mode=colocated"]
    recipe = benchlib.prepare_recipe(recipe_class, module.Config, overrides, on_step_end)
    if mode == "sft":
        per_row = [len(e["input_ids"]) for e in recipe.train_examples]
    else:
        per_row = [len(e["chosen_input_ids"]) + len(e["rejected_input_ids"]) for e in recipe.train_examples]
    return recipe, per_row


# ------------------------------------------------------------------------------------------------ TRL side
def trl_trainer(mode: str, model_dir: Path, work: Path, batch: int, total_steps: int, rows: int, callback):
    """TRL's SFTTrainer or DPOTrainer on the same model and rows, and the tokens of each training row."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    # DESIGN §11: TRL defaults to bf16 and gradient checkpointing; both are off on our side.
    common = dict(output_dir=str(work), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                  max_steps=total_steps, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=WARMUP_LR_STEPS,
                  adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
                  report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
                  dataloader_num_workers=0, seed=0, disable_tqdm=True, max_length=MAX_LEN,
                  **benchlib.no_recomputation(TrainingArguments))
    if mode == "sft":
        from trl import SFTConfig, SFTTrainer

        source = benchlib.read_jsonl(benchlib.DATA / "sft_train.jsonl")[:rows]
        data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in source])
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, packing=False), train_dataset=data,
                             processing_class=tokenizer, callbacks=[callback])
        return trainer, [len(ids) for ids in trainer.train_dataset["input_ids"]]
    from trl import DPOConfig, DPOTrainer

    source = benchlib.read_jsonl(benchlib.DATA / "pref_train.jsonl")[:rows]
    data = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in source])
    trainer = DPOTrainer(model=model, args=DPOConfig(**common, beta=0.1, loss_type=["sigmoid"],
                                                     precompute_ref_log_probs=False),
                         train_dataset=data, processing_class=tokenizer, callbacks=[callback])
    return trainer, _trl_pair_tokens(trainer.train_dataset)


def _trl_pair_tokens(dataset) -> list[int]:
    """Tokens of prompt+chosen plus prompt+rejected per pair, whichever columns this TRL version keeps."""
    columns = set(dataset.column_names)
    for prompt, chosen, rejected in (("prompt_input_ids", "chosen_input_ids", "rejected_input_ids"),
                                     ("prompt_ids", "chosen_ids", "rejected_ids")):
        if {prompt, chosen, rejected} <= columns:
            return [2 * len(p) + len(c) + len(r)
                    for p, c, r in zip(dataset[prompt], dataset[chosen], dataset[rejected])]
    raise RuntimeError(f"cannot count tokens in TRL's DPO dataset: columns {sorted(columns)}")


@contextlib.contextmanager
def single_process_view():
    """Make TRL see a plain single process.

    This process also holds hpc_rlhf's one-rank torch.distributed world, whose launch variables (LOCAL_RANK,
    WORLD_SIZE, ...) would make accelerate treat TRL's run as distributed and wrap the model in DDP with
    find_unused_parameters=True: an extra autograd traversal per step that a single-process TRL user never
    pays. accelerate caches its state, so it is reset; the variables come back afterwards. (DeepSpeed reads
    them when an engine is built, which happens before this.)
    """
    from accelerate.state import AcceleratorState

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.update(saved)


# ------------------------------------------------------------------------------------------------ one round
def measure(mode: str, model_dir: Path, work: Path, args, first: str) -> tuple[dict, dict]:
    """One lockstep run of both sides: ({side: steady step times}, {side: mean tokens per row})."""
    from transformers import TrainerCallback

    lock = benchlib.Lockstep(first, SIDES[1] if first == SIDES[0] else SIDES[0])
    total = args.warmup + args.steps

    class TakeTurns(TrainerCallback):
        def on_train_begin(self, *_, **__):
            lock.begin("trl")

        def on_step_end(self, *_, **__):
            lock.step_done("trl")

    recipe, hpc_rows = hpc_recipe(mode, model_dir, work / "hpc", args.batch_size, total, args.rows,
                                  lambda: lock.step_done("hpc_rlhf"))

    def hpc_loop() -> None:
        lock.begin("hpc_rlhf")
        recipe.train()

    with single_process_view():
        trainer, trl_rows = trl_trainer(mode, model_dir, work / "trl", args.batch_size, total, args.rows,
                                        TakeTurns())

        def trl_loop() -> None:
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # TRL prints a summary
                trainer.train()

        lock.run({"hpc_rlhf": hpc_loop, "trl": trl_loop})
    times = {side: lock.durations[side][args.warmup:total] for side in SIDES}
    per_row = {"hpc_rlhf": sum(hpc_rows) / len(hpc_rows), "trl": sum(trl_rows) / len(trl_rows)}
    return times, per_row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["sft", "dpo"], choices=["sft", "dpo"])
    parser.add_argument("--rounds", type=int, default=2, help="lockstep runs per mode (who starts alternates)")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per side and round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of every round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=2048,
                        help="training rows each side tokenises (set-up cost only; the rows are alike)")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step pays one-time costs)")

    benchlib.set_torch_threads()
    benchlib.ensure_assets()
    benchlib.init_one_rank_world()
    import trl  # noqa: F401  (fail before any measurement when TRL is missing)

    benchlib.header("SFT / DPO throughput: hpc_rlhf vs TRL, one process, one thread, steps taken in turns")
    times: dict[tuple[str, str], list[float]] = {}
    pair_ratios: dict[str, list[float]] = {}
    per_row: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = benchlib.make_bench_model(tmp / "bench-llama")
        print(f"   model: Llama h128 x 2 layers, {benchlib.count_params(model_dir):,} parameters, fp32, sdpa; "
              f"batch {args.batch_size}; {args.steps} timed steps per side after {args.warmup}; "
              f"{args.rounds} rounds", flush=True)
        for r in range(args.rounds):
            for mode in args.modes:
                first = SIDES[r % 2]
                got, rows = measure(mode, model_dir, tmp / f"{mode}-{r}", args, first)
                for side in SIDES:
                    times.setdefault((mode, side), []).extend(got[side])
                    per_row[(mode, side)] = rows[side]
                pairs = [t / h for h, t in zip(got["hpc_rlhf"], got["trl"])]
                pair_ratios.setdefault(mode, []).extend(pairs)
                print(f"   round {r + 1} {mode}: median step hpc_rlhf {benchlib.median(got['hpc_rlhf']) * 1e3:.1f} ms, "
                      f"TRL {benchlib.median(got['trl']) * 1e3:.1f} ms ({first} first)", flush=True)
    print(f"   machine after: {benchlib.machine_state()}\n")
    rows = []
    for mode in args.modes:
        for side in SIDES:
            step_s = benchlib.median(times[(mode, side)])
            lo, hi = benchlib.quartiles(times[(mode, side)])
            rows.append([mode, side, 1 / step_s, f"{1 / hi:.1f}-{1 / lo:.1f}",
                         args.batch_size * per_row[(mode, side)] / step_s, per_row[(mode, side)],
                         f"{benchlib.median(pair_ratios[mode]):.2f}x" if side == "hpc_rlhf" else ""])
    print(benchlib.table(["mode", "side", "steps/s", "steps/s (IQR)", "tokens/s", "tok/row",
                          "hpc_rlhf / TRL (paired)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
