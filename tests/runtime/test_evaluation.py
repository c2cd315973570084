"""Held-out prompts for the exact-match evaluation the sft, dpo and kto recipes share."""

from __future__ import annotations

from hpc_rlhf.runtime.evaluation import load_eval_prompts
from tests.recipes import sft_config


def test_load_eval_prompts(world, tmp_path):
    cfg = sft_config(tmp_path, "eval.max_rows=5")
    rows = load_eval_prompts(cfg)
    assert len(rows) == 5
    assert all(isinstance(r[cfg.data.prompt_key], str) and isinstance(r[cfg.data.answer_key], str) for r in rows)
    assert load_eval_prompts(sft_config(tmp_path, "eval.prompt_files=[]")) == []
