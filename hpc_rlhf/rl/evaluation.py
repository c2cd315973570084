"""The RL run's held-out evaluation: greedy generations of the evaluation prompts by the rollout engines, judged on
rank 0 (the only rank that gets them): exact match of the answers, or with an environment the mean reward of
greedy episodes and their tool calls."""

from __future__ import annotations

from hpc_rlhf.data.synthetic import exact_match
from hpc_rlhf.dist import watchdog
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.rl import episodes, messages
from hpc_rlhf.rl.config import Config, response_limit
from hpc_rlhf.rl.rollout import Generation
from hpc_rlhf.rl.routes import Routes


def evaluate(cfg: Config, routes: Routes, generate: Generation, prompts: list[dict], tokenizer) -> dict[str, float]:
    """The figures on rank 0, nan elsewhere (and everywhere without evaluation prompts). Every rank calls it."""
    if not prompts:
        return {"eval_accuracy": float("nan")}
    env = cfg.env.enabled
    _, max_tokens = response_limit(cfg, evaluation=True)
    per_turn = cfg.rollout.max_new_tokens if env else cfg.eval.max_new_tokens  # episodes: turns as in training
    share = generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=per_turn), phase="eval")
    with watchdog.phase("exchange"):
        generated = messages.share_generated(routes, share, "eval", len(prompts), 1, max_tokens, with_episodes=env)
    if generated is None:
        return {"eval_accuracy": float("nan")}
    if env:
        return {"eval_accuracy": float(episodes.field(generated, "env_reward").mean()),
                "eval_tool_calls_mean": float(episodes.field(generated, "tool_calls").mean())}
    texts = [tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in generated.responses]
    answered = [p for p in prompts if p["answer"] is not None]
    correct = sum(exact_match(t, p["answer"]) for t, p in zip(texts, prompts) if p["answer"] is not None)
    return {"eval_accuracy": correct / max(1, len(answered))}
