"""Phases 4-5 of the RL step, scoring (`Scoring`): actor (old log-probs), critic (values), ref and teacher (log-probs)
and each reward model (scores) on their contiguous shard of the samples, all at the same time on their own ranks, each
gathered to its role's leader; the rule and remote rewards once, on one rank; then every result to the trained
roles (messages.share_scores).

The trained roles score through their module's forward: under ZeRO-3 its hooks fetch one layer at a time, as for
the frozen roles (never the whole model at once), and keep DeepSpeed's collectives in the role's group
(engines.deepspeed_compat.keep_module_in_group, for every ZeRO-3 model).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf import rewards as reward_fns
from hpc_rlhf.dist import exchange, groups, watchdog
from hpc_rlhf.models.lora import adapter_disabled
from hpc_rlhf.rl import episodes, messages, micro_batches
from hpc_rlhf.rl.batches import SampleBatch, make_batch, shard_bounds, to_ragged
from hpc_rlhf.rl.config import reward_role_names
from hpc_rlhf.rl.packed import PADDED, Layout, logits_at, policy_forward, score_forward, value_forward
from hpc_rlhf.rl.routes import Routes
from hpc_rlhf.runtime.process_rewards import ProcessRewardSpec, rewards_of_steps, step_positions
from hpc_rlhf.utils.http_post import headers_from_env, shown_url


def score_on_shard(role: str, samples: int, micro: int, batch_of: Callable[[int, int], SampleBatch],
                   one: Callable[[SampleBatch], list[torch.Tensor]], name: str | None = None, *,
                   lengths: Sequence[int] | None = None, micro_tokens: int = 0) -> list[torch.Tensor] | None:
    """`one` over this rank's contiguous shard of the `samples` in micro-batches of `micro` samples, or of at most
    `micro_tokens` tokens (rl.micro_batch_tokens; `lengths`: every sample's tokens); the role leader gets every
    rank's results in sample order (None elsewhere). Every rank of the role runs as many passes as the replica
    that needs the most (a ZeRO-3 model gathers parameters collectively in each): the extra ones on one sample,
    dropped. `name`: what is computed, when not the role's own result (the reference on the actor's ranks).
    A sequence-parallel role's blocks (placement key `<kind>_sp`) take a shard each, computed together by the
    block's ranks; the block's first rank hands the results on."""
    size, index = len(groups.role_ranks(role)), groups.rank_in_role(role)
    per_block = len(groups.sequence_ranks(role))
    replicas = size // per_block
    if micro_tokens and lengths is None:
        raise ValueError("micro-batches by tokens need the samples' lengths")
    lengths = list(lengths) if lengths is not None else [0] * samples
    bounds = [shard_bounds(samples, replicas, r) for r in range(replicas)]
    start, end = bounds[index // per_block]
    mine = [(start + a, start + b) for a, b in micro_batches.cuts(lengths[start:end], micro, micro_tokens)]
    passes = micro_batches.passes([lengths[a:b] for a, b in bounds], micro, micro_tokens)
    results = []
    for p in range(passes):
        if p < len(mine):
            results += one(batch_of(*mine[p]))
        else:
            one(batch_of(0, 1))
    if index % per_block:
        results = []  # the block's first rank has the same
    gathered = exchange.gather_ragged(results, dst=groups.role_leader(role), group=groups.role_group(role),
                                      tag=f"{name or role}-scores", dtype=torch.float32)
    return exchange.flatten_ranks(gathered) if gathered is not None else None


def rule_scores(routes: Routes, cfg, rule_functions, tokenizer, prompts: list[str],
                responses: list[torch.Tensor] | None, answers: list[str | None]) -> list[torch.Tensor] | None:
    """Rule functions and the HTTP endpoint, weighted and summed, computed once on the sender of the route
    `scores/rules` (the only rank that decodes the responses): [(B,)] there, None elsewhere."""
    if dist.get_rank() != routes["scores/rules"].src:
        return None
    texts = [tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in responses]
    total = torch.zeros(len(texts))
    weights = cfg.reward.function_weights or [1.0] * len(rule_functions)
    for (spec, fn), w in zip(rule_functions, weights):
        what = f"reward function '{spec}'"
        total += reward_fns.check_weighted(
            w * torch.tensor(reward_fns.call_reward_function(fn, spec, prompts, texts, answers)), what)
        total = reward_fns.check_weighted(total, f"the rule rewards up to {what}")
    if cfg.reward.http_url:
        what = f"reward endpoint {shown_url(cfg.reward.http_url)}"
        try:  # read here, on the one rank that calls the endpoint: the values stay in this process
            headers = headers_from_env(cfg.reward.http_headers_from_env, "reward.http_headers_from_env")
        except ValueError as exc:
            raise reward_fns.RewardFunctionError(str(exc)) from None
        with watchdog.waiting_on(what):  # named as the cause if the others time out meanwhile
            remote = reward_fns.remote_rewards(cfg.reward.http_url, prompts, texts, answers,
                                               timeout_s=cfg.reward.http_timeout_s,
                                               max_reply_mb=cfg.reward.http_max_reply_mb, headers=headers)
        total += reward_fns.check_weighted(cfg.reward.http_weight * torch.tensor(remote), what)
        total = reward_fns.check_weighted(total, f"the rule rewards up to {what}")
    return [total]


# ------------------------------------------------------------------------------------------ what each role computes
def logprobs_of(model, temperature: float, adapter_off: bool = False, layout: Layout = PADDED
                ) -> Callable[[SampleBatch], list[torch.Tensor]]:
    """Per-token log-probs of the responses under `model` (actor, ref), as the engines report theirs: of the
    sampling distribution softmax(logits / T). `adapter_off`: under a LoRA actor's base model, its adapter
    disabled (the reference of ref_mode=adapter_disabled). `layout`: padded or packed rows (rl.padding_free)."""
    def one(sub: SampleBatch) -> list[torch.Tensor]:
        with adapter_disabled(model) if adapter_off else contextlib.nullcontext():
            logps, _ = policy_forward(model, sub, temperature, layout)
        return to_ragged(logps, sub)
    return one


def values_of(model, layout: Layout = PADDED) -> Callable[[SampleBatch], list[torch.Tensor]]:
    """Per-token values of the responses under a value model (the critic)."""
    def one(sub: SampleBatch) -> list[torch.Tensor]:
        return to_ragged(value_forward(model, sub, layout)[:, :-1].float(), sub)
    return one


def scores_of(model, normalize: bool, layout: Layout = PADDED) -> Callable[[SampleBatch], list[torch.Tensor]]:
    """One score per sample from a reward model."""
    def one(sub: SampleBatch) -> list[torch.Tensor]:
        scores = score_forward(model, sub, normalize, layout)
        return [v.reshape(1).float().cpu() for v in scores]
    return one


def process_scores_of(model, spec: ProcessRewardSpec, how: str, layout: Layout = PADDED
                      ) -> Callable[[SampleBatch], list[torch.Tensor]]:
    """One reward per sample from a process reward model: the steps the policy marked in its response (generated
    tokens only: action_mask[j - 1] covers token j), aggregated."""
    def one(sub: SampleBatch) -> list[torch.Tensor]:
        generated = torch.zeros_like(sub.input_ids, dtype=torch.bool)
        generated[:, 1:] = sub.action_mask > 0
        positions = step_positions(sub.input_ids, generated, spec.marker_id)
        rewards = rewards_of_steps(logits_at(model, sub, positions, layout), positions, spec, how)
        return [v.reshape(1) for v in rewards]
    return one


@torch.no_grad()
def score_roles(scorers: dict[str, Callable[[SampleBatch], list[torch.Tensor]]],
                sample_prompts: Sequence[Sequence[int]], responses: Sequence[torch.Tensor], pad_id: int, micro: int,
                device: Any, computed_by: dict[str, str] | None = None, micro_tokens: int = 0
                ) -> dict[str, list | None]:
    """Each role this rank holds (`scorers`: role -> what it computes for a micro-batch) on its shard of the
    samples (prompt ids and responses per sample); per role, every rank's results on the role's leader, None on
    its other ranks. `computed_by`: the role whose ranks compute a result that is not a role of its own (the
    reference of ref_mode=adapter_disabled: "ref" -> "actor"). `micro_tokens`: micro-batches of at most that many
    tokens instead of `micro` samples (rl.micro_batch_tokens)."""
    def batch_of(start: int, end: int) -> SampleBatch:
        return make_batch(sample_prompts[start:end], responses[start:end], pad_id).to(device)

    computed_by = computed_by or {}
    if not scorers:
        return {}  # a rank without a scoring role (a rollout engine's) has no responses here
    lengths = [len(p) + len(r) for p, r in zip(sample_prompts, responses)] if micro_tokens else None
    return {name: score_on_shard(computed_by.get(name, name), len(sample_prompts), micro, batch_of, one, name,
                                 lengths=lengths, micro_tokens=micro_tokens)
            for name, one in scorers.items()}


class Scoring:
    """Phases 4-5 on this rank: each scoring role it holds on its shard (the trained roles' modules, the frozen
    ref and reward models), the rule and remote rewards on their rank, then every result to the trained roles
    (messages.share_scores). Built once in the recipe's set-up from the roles this rank holds."""

    def __init__(self, cfg, routes: Routes, tokenizer, device, temperature: float, *, actor=None, critic=None,
                 ref=None, teacher=None, reward_models: dict | None = None, rule_functions=(),
                 ref_from_actor: bool = False, layouts: Mapping[str, Layout] | None = None,
                 process_specs: Mapping[str, ProcessRewardSpec] | None = None):
        self.cfg, self.routes, self.tokenizer, self.device = cfg, routes, tokenizer, device
        layouts = layouts or {}

        def layout_of(role: str) -> Layout:  # each role's rows: padded, packed, shared by a sequence block
            return layouts.get(role, PADDED)

        self.scorers = {}  # in role order: a rank holding colocated roles scores them in the same order as its peers
        # The actor scores its old log-probs unless rl.old_logprobs takes them from elsewhere (experience.py).
        self.actor_scores = cfg.rl.old_logprobs == "recompute"
        if actor is not None:
            if self.actor_scores:
                self.scorers["actor"] = logprobs_of(actor.module, temperature, layout=layout_of("actor"))
            if ref_from_actor:  # the same module, its adapter off
                self.scorers["ref"] = logprobs_of(actor.module, temperature, adapter_off=True,
                                                  layout=layout_of("actor"))
        if critic is not None:
            self.scorers["critic"] = values_of(critic.module, layout_of("critic"))
        if ref is not None:
            self.scorers["ref"] = logprobs_of(ref.model, temperature, layout=layout_of("ref"))
        if teacher is not None:  # on-policy distillation: the teacher's log-probs of the sampled tokens
            self.scorers["teacher"] = logprobs_of(teacher.model, temperature, layout=layout_of("teacher"))
        for name, frozen in (reward_models or {}).items():
            if name in (process_specs or {}):  # a process reward model: its steps' scores
                self.scorers[name] = process_scores_of(frozen.model, process_specs[name],
                                                       cfg.reward.process_aggregate, layout_of(name))
            else:
                self.scorers[name] = scores_of(frozen.model, cfg.reward.normalize, layout_of(name))
        self.computed_by = {"ref": "actor"} if ref_from_actor else None
        self.rule_functions = list(rule_functions)
        self.with_rules = bool(self.rule_functions or cfg.reward.http_url)
        plan = routes.plan
        self.roles = [r for r in ["actor", "critic", "ref", "teacher", *reward_role_names(len(cfg.reward.models))]
                      if (plan.has(r) or (r == "ref" and ref_from_actor)) and (r != "actor" or self.actor_scores)]

    def __call__(self, batch: SampleBatch | None, prompt_ids: Sequence[Sequence[int]], texts: list[str],
                 answers: list[str | None], generated) -> dict[str, torch.Tensor]:
        """A batch's scores on the trained roles' ranks ({} elsewhere), dense: (B, T-1) per-token tensors for
        actor, critic and ref, (B,) scores of each reward model and "rules" (rule/remote, and with episodes the
        environment's reward, weighted by env.reward_weight). Per sample: its prompt's ids, text and answer."""
        cfg = self.cfg
        responses = None if generated is None else generated.responses
        local = score_roles(self.scorers, prompt_ids, responses, self.tokenizer.pad_token_id,
                            cfg.train.micro_batch_size, self.device, computed_by=self.computed_by,
                            micro_tokens=cfg.rl.score_micro_batch_tokens or cfg.rl.micro_batch_tokens)
        rules = (rule_scores(self.routes, cfg, self.rule_functions, self.tokenizer, texts, responses, answers)
                 if self.with_rules else None)
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            scored = messages.share_scores(self.routes, local, self.roles, rules, self.with_rules, batch)
        if generated is not None and generated.episodes is not None and "rules" in scored:
            scored["rules"] = reward_fns.check_weighted(
                scored["rules"] + cfg.env.reward_weight * episodes.field(generated, "env_reward"),
                f"the environment '{cfg.env.name or shown_url(cfg.env.http_url)}' with the rule rewards")
        check_model_scores(cfg, scored)
        return scored


def check_model_scores(cfg, scored: dict[str, torch.Tensor]) -> None:
    """Each reward model's weighted scores, and their sum with the other rewards, must be finite in float32: found
    here, the error names the model; found in training, it would be a skipped step naming nothing."""
    names = reward_role_names(len(cfg.reward.models))
    weights = cfg.reward.model_weights or [1.0] * len(names)
    total = scored["rules"].float() if "rules" in scored else None
    for name, path, weight in zip(names, cfg.reward.models, weights):
        if name in scored:
            weighted = reward_fns.check_weighted(weight * scored[name].float(),
                                                 f"reward model {path} (role {name}, weight {weight:g})")
            total = weighted if total is None else total + weighted
    if total is not None:
        reward_fns.check_weighted(total, "the sum of the rewards (rule, remote, environment and reward models)")
