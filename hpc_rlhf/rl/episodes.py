"""Multi-turn episodes in the RL step (`env.name` or `env.http_url`): a sample is an episode, where the model acts,
an environment answers, and the loop repeats until the episode ends (DESIGN §4, last paragraph).

The episodes are played where generation runs, on each rollout engine's first rank, by hpc_rlhf.envs'
`run_episodes` (every live episode of a turn in one generate call; the model's tokens kept exactly as sampled,
observations tokenised once). What the rest of the step needs of them travels with the responses
(messages.share_responses): the mask of the model's own tokens, which becomes the action mask, so that the policy
loss, the KL, the entropy, the critic's value loss and GAE see the model's tokens only; and EPISODE_FIELDS, from
which the environment's reward joins the other rewards (weighted by env.reward_weight) and the step's figures
(turns_mean, tool_calls_mean, env_time_share, episodes_truncated, ...) are made.

An episode dropped by env.on_error=skip has an empty mask: nothing of it is trained on; its reward counts as 0
in its group's baseline.
"""

from __future__ import annotations

import torch

from hpc_rlhf.dist import watchdog
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.episodes import METRIC_SUMS, EpisodeBatch, metrics_from_sums, run_episodes
from hpc_rlhf.envs.loading import load_environment
from hpc_rlhf.rl.batches import EPISODE_FIELDS, Generated


class EpisodePlayer:
    """Plays a rollout engine's share of a batch as episodes (built once, on the engines' first ranks)."""

    def __init__(self, settings: EnvSection, tokenizer, chat: bool):
        self.settings, self.tokenizer, self.chat = settings, tokenizer, chat
        self.env = load_environment(settings)

    def __call__(self, rollout, prompts: list[dict], sampling) -> Generated:
        """`prompts`: prompt rows with "input_ids" and the data "row" that starts each episode."""
        lockstep = getattr(rollout, "sync_group", None) is not None  # ZeRO-3 hybrid: generate calls are collectives
        played = run_episodes([p["row"] for p in prompts], [p["input_ids"] for p in prompts], rollout.generate,
                              sampling, env=self.env, tokenizer=self.tokenizer, settings=self.settings,
                              chat=self.chat, lockstep=lockstep, waiting=watchdog.waiting_on)
        return as_generated(played)

    @staticmethod
    def nothing() -> Generated:
        return Generated([], [], [], torch.zeros(0, len(EPISODE_FIELDS)))


def as_generated(played: EpisodeBatch) -> Generated:
    """Episodes as what the exchange carries (their engine's times spread over them, so that sums are totals)."""
    count = max(len(played.episodes), 1)
    figures = torch.tensor([[e.reward, e.turns, e.tool_calls, float(e.truncated), float(e.failed),
                             played.env_s / count, played.wall_s / count] for e in played.episodes],
                           dtype=torch.float32).reshape(-1, len(EPISODE_FIELDS))
    return Generated([e.tokens for e in played.episodes], [e.logprobs for e in played.episodes],
                     [e.mask for e in played.episodes], figures)


def field(generated: Generated, name: str) -> torch.Tensor:
    """One of EPISODE_FIELDS of every episode, (samples,)."""
    return generated.episodes[:, EPISODE_FIELDS.index(name)]


def episode_figures(generated: Generated) -> dict[str, float]:
    """The step's figures of its episodes (turns_mean, tool_calls_mean, episode_reward_mean, episode_tokens_mean,
    episodes_truncated, episodes_failed, env_time_share), as hpc_rlhf.envs computes them for one engine."""
    kept = field(generated, "failed") == 0
    tokens = torch.tensor([float(len(r)) for r in generated.responses])
    sums = {"episodes": float(len(generated)), "episodes_kept": float(kept.sum()),
            "turns": float(field(generated, "turns")[kept].sum()),
            "tool_calls": float(field(generated, "tool_calls")[kept].sum()),
            "episode_reward": float(field(generated, "env_reward")[kept].sum()),
            "episode_tokens": float(tokens[kept].sum()),
            "episodes_truncated": float(field(generated, "truncated").sum()),
            "episodes_failed": float((~kept).sum()),
            "env_s": float(field(generated, "env_s").sum()), "wall_s": float(field(generated, "wall_s").sum())}
    assert set(sums) == set(METRIC_SUMS)
    return metrics_from_sums(sums)


def truncated(generated: Generated | None) -> torch.Tensor | None:
    """(samples,) bool: the episodes cut at env.max_episode_tokens (None without episodes): what the overlong
    filter drops for episodes."""
    if generated is None or generated.episodes is None:
        return None
    return field(generated, "truncated") > 0
