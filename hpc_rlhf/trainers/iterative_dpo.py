"""`hpc-rlhf idpo`: iterative (online) DPO in rounds: generate -> score -> pair best with worst -> DPO.

One round: sample `generate.n` responses per prompt from the current policy (resumable, see generate.py), score
them, make one preference pair per prompt (chosen = highest score, rejected = lowest; prompts whose best and
worst differ by no more than `pairs.min_gap` teach nothing and are dropped), and train on the pairs with the DPO
recipe. The reference of round r is the policy round r started from (`ref.path` unset) or a fixed model
(`ref.path`). The next round samples from the trained policy on the next `data.max_train_rows` prompts.

What the rounds are for, measured on the built-in task from an SFT model that gets 0.98 of the held-out problems
without a carry and 0.28 of those with one right (tests/trainers/test_iterative_dpo.py, 500 prompts): round 1's
pairs come mostly from carry problems (the others are rarely answered wrong), so DPO on them teaches "one more in
the tens" and the policy overshoots: carry problems 0.28 -> 0.96, the others 0.98 -> 0.64 (all 0.66 -> 0.78).
Round 2 samples that policy, 60% of its pairs (18% in round 1) are problems without a carry answered 10 too
high, and it corrects them: 0.86 and 0.95 (all 0.91). Fixed offline pairs cannot do that; pairs sampled from the
current policy aim at its current mistakes. What mattered (two rounds, 200 prompts, start 0.695):
- the NLL term on the chosen answers (`dpo.sft_weight`, 1 by default here): without it round 1 fell to 0.045
  (60 steps), as plain DPO lowers the chosen answers' likelihood too and greedy decoding goes elsewhere;
- a learning rate for a policy that is already good: 1e-3 gave 0.575 -> 0.655, 1e-4 0.705 -> 0.89, 3e-5 0.77 ->
  0.89 (40 steps of 32 pairs a round);
- sampling temperature: at 0.7 fewer problems without a carry give pairs and round 1 overshoots further (0.68 ->
  0.86); at 1.3 more do, round 1 overshoots less and leaves round 2 less to do (0.875 -> 0.935).

Round r lives in `output_dir/round_<r>/` (chunks, `pairs.jsonl`, the DPO run under `dpo/`); `rounds.json` counts
finished rounds, so a restarted job resumes at its round (and within it at its chunk or DPO checkpoint). The last
policy is copied to `output_dir/final/`; `metrics.jsonl` has one row per round.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from hpc_rlhf.config import DataSection
from hpc_rlhf.trainers import dpo, rounds
from hpc_rlhf.trainers.config import PreferenceDataSection
from hpc_rlhf.trainers.config import IterativeDPOConfig as Config  # the mode's keys, torch-free for --dry-run


def preference_pairs(records: Sequence[dict], min_gap: float = 0.0) -> list[dict]:
    """Scored samples -> one {"prompt", "chosen", "rejected", "chosen_score", "rejected_score", "index"} per prompt
    whose best and worst scores differ by more than `min_gap` (ties: the earlier sample). Blank responses (the
    policy stopped at once) are left out: the preference data loader refuses blank text, so they cannot be a side
    of a pair, and at temperature 1.3 a few appeared in round 3 of the built-in task and stopped the run."""
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record["response"].strip():
            by_prompt[record["index"]].append(record)
    pairs = []
    for index in sorted(by_prompt):
        ranked = sorted(by_prompt[index], key=lambda r: (-r["score"], r["sample"]))
        best = ranked[0]
        worst = min(ranked, key=lambda r: (r["score"], r["sample"]))
        if best["score"] - worst["score"] <= min_gap or best["response"] == worst["response"]:
            continue
        pairs.append({"prompt": best["prompt"], "chosen": best["response"], "rejected": worst["response"],
                      "chosen_score": best["score"], "rejected_score": worst["score"], "index": index})
    return pairs


def dpo_config_for(cfg: Config, model_path: str, pairs_file: Path, output_dir: Path):
    shared = {f.name: getattr(cfg.data, f.name) for f in dataclasses.fields(DataSection)}
    data = PreferenceDataSection(**{**shared, "train_files": [str(pairs_file)], "eval_files": [],
                                    "max_train_rows": None, "prompt_key": "prompt", "chosen_key": "chosen",
                                    "rejected_key": "rejected"})
    return dpo.Config(output_dir=str(output_dir), model=dataclasses.replace(cfg.model, path=model_path),
                      ref=cfg.ref, dpo=cfg.dpo, data=data, train=cfg.train, eval=cfg.eval, log=cfg.log,
                      checkpoint=cfg.checkpoint, dist=cfg.dist)


def run(cfg: Config) -> dict[str, Any]:
    run_, all_rows, done, logger = rounds.start_rounds(cfg, "idpo")
    last: dict[str, Any] = {}
    model_path = str(rounds.round_dir(run_, done) / "dpo" / "final") if done else cfg.model.path
    for r, round_dir in rounds.remaining_rounds(run_, done, cfg.rounds):
        rows = rounds.round_prompts(all_rows, cfg.data.max_train_rows, r - 1)
        records = rounds.sample_round(cfg, run_, model_path, rows, round_dir)
        if records is None:
            return {"complete": False, "round": r}
        pairs = preference_pairs(records, cfg.pairs.min_gap)
        if not pairs:
            raise RuntimeError(f"round {r}: no prompt had samples with different scores (pairs.min_gap="
                               f"{cfg.pairs.min_gap}); sample more (generate.n) or at a higher temperature")
        pairs_file = round_dir / "pairs.jsonl"
        if run_.is_main:
            tmp = pairs_file.with_name(pairs_file.name + ".tmp")
            tmp.write_text("".join(json.dumps(p) + "\n" for p in pairs))
            tmp.replace(pairs_file)
        dist.barrier()
        last = {"mean_score": sum(rec["score"] for rec in records) / len(records), "pairs": len(pairs)}
        last.update(dpo.run(dpo_config_for(cfg, model_path, pairs_file, round_dir / "dpo")) or {})
        model_path = str(round_dir / "dpo" / "final")
        rounds.finish_round(run_, logger, r, last)
    rounds.copy_final(Path(model_path), run_.output_dir / "final")
    logger.close()
    return {"complete": True, "round": cfg.rounds, **last}
