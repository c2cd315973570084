"""Batch generation: a run stopped after some chunks and resumed writes the same file as an uninterrupted run;
rule scores are attached; two ranks write the same file as one; bad settings on resume are named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpc_rlhf.config import TINY_ASSETS, ConfigError, load_config

DATA = f"{TINY_ASSETS}/data"
TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"
BASE = ["data.max_train_rows=10", "generate.n=3", "generate.chunk_size=3", "generate.max_new_tokens=4",
        "generate.temperature=1.0", "generate.seed=5", "score.functions=[exact_match]"]


def gen_config(out: Path, *overrides: str):
    from hpc_rlhf.trainers import generate

    return load_config(generate.Config, None, [f"output_dir={out}", *BASE, *overrides])


def test_pure_helpers():
    from hpc_rlhf.trainers.generate import chunk_bounds, prompt_seed, rank_chunks

    assert rank_chunks(7, 1, 3) == [1, 4]
    assert rank_chunks(2, 2, 3) == []
    assert chunk_bounds(10, 3, 3) == (9, 10)
    assert prompt_seed(2, 7) == 2_000_013


def test_restart_after_some_chunks_gives_the_uninterrupted_file(world, tmp_path):
    from hpc_rlhf.trainers import generate

    whole = generate.run(gen_config(tmp_path / "whole"))
    assert whole == {"complete": True, "chunks": 4, "chunks_done": 4, "generated_chunks": 4}
    expected = (tmp_path / "whole" / "generations.jsonl").read_text()

    first = generate.run(gen_config(tmp_path / "cut", "generate.max_chunks_per_job=2"))
    assert first["complete"] is False and first["chunks_done"] == 2
    assert not (tmp_path / "cut" / "generations.jsonl").exists()
    second = generate.run(gen_config(tmp_path / "cut"))
    assert second["complete"] and second["generated_chunks"] == 2  # only the missing chunks were generated
    assert (tmp_path / "cut" / "generations.jsonl").read_text() == expected

    rows = [json.loads(line) for line in expected.splitlines()]
    assert len(rows) == 30 and [(r["index"], r["sample"]) for r in rows[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    prompts = [json.loads(line) for line in Path(f"{DATA}/prompts_train.jsonl").read_text().splitlines()[:10]]
    for r in rows:
        assert r["prompt"] == prompts[r["index"]]["prompt"] and r["answer"] == prompts[r["index"]]["answer"]
        assert r["score"] == r["scores"]["exact_match"] == (1.0 if r["response"].strip() == r["answer"] else 0.0)
    assert len({r["response"] for r in rows}) > 3  # sampled, not one repeated string

    # another seed gives other samples: the file really depends on the per-prompt seeds
    generate.run(gen_config(tmp_path / "other", "generate.seed=6"))
    assert (tmp_path / "other" / "generations.jsonl").read_text() != expected


def test_resume_with_changed_settings_is_refused(world, tmp_path):
    from hpc_rlhf.trainers import generate

    generate.run(gen_config(tmp_path / "g", "generate.max_chunks_per_job=1"))
    with pytest.raises(ConfigError, match="chunk_size"):
        generate.run(gen_config(tmp_path / "g", "generate.chunk_size=4"))


def test_two_ranks_write_the_one_rank_file(world, tmp_path):
    from hpc_rlhf.trainers import generate
    from tests.distributed import run_ranks

    generate.run(gen_config(tmp_path / "one"))
    run_ranks(2, __file__, "two", str(tmp_path / "two"), timeout=120)
    assert (tmp_path / "two" / "generations.jsonl").read_text() == (tmp_path / "one" / "generations.jsonl").read_text()
    markers = [json.loads(p.read_text())["rank"] for p in sorted((tmp_path / "two" / "chunks").glob("*.done"))]
    assert markers == [0, 1, 0, 1]  # every world-th chunk per rank


if __name__ == "__main__":
    import torch.distributed as dist

    from hpc_rlhf.dist.bootstrap import init_distributed
    from hpc_rlhf.trainers import generate

    case, out = sys.argv[1], sys.argv[2]
    assert case == "two"
    init_distributed("gloo", 120, expected_world_size=2)
    generate.run(gen_config(Path(out)))
    dist.barrier()
    dist.destroy_process_group()


def test_a_process_reward_model_scores_the_steps_of_each_response(world, tmp_path):
    """score.reward_models takes a process reward model (runtime/process_rewards.py): each response's score is its
    own steps' aggregate, the prompt's markers not counted, as computed for each sample alone; a generate run
    writes it beside the rule score."""
    import torch

    from hpc_rlhf.config import ModelSection
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.trainers import generate
    from hpc_rlhf.trainers.config import ScoreSection
    from tests.runtime.test_process_rewards import PROMPTS, RESPONSES, by_hand, make_prm_folder

    prm = make_prm_folder(tmp_path / "prm")
    tokenizer = load_tokenizer(prm, pad_to_eos=True)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    scorer = generate.Scorer(ScoreSection(reward_models=[str(prm)], process_aggregate="last", micro_batch_size=2),
                             ModelSection(path=TINY_MODEL), torch.device("cpu"))
    records = [{"prompt": p} for p in PROMPTS]
    scorer.score(records, RESPONSES, [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts],
                 tokenizer.pad_token_id)
    model = scorer.reward_models[0][1]
    expected = [by_hand(model, scorer.reward_models[0][2], p, r, "last") for p, r in zip(prompts, responses)]
    assert [r["score"] for r in records] == pytest.approx(expected, abs=1e-6)
    assert expected[1] == 0.0 and 0 < expected[0] < 1

    generate.run(gen_config(tmp_path / "out", f"model.path={TINY_MODEL}", f"score.reward_models=[{prm}]",
                            "generate.max_new_tokens=4"))
    rows = [json.loads(line) for line in (tmp_path / "out" / "generations.jsonl").read_text().splitlines()]
    assert all(set(r["scores"]) == {"exact_match", str(prm)} and 0 <= r["scores"][str(prm)] <= 1 for r in rows)
