"""`hpc-rlhf ppo` (and `hpc-rlhf grpo`): RL from rewards with every role on its own process group.

Every rank runs this same loop; `groups.has_role(...)` decides what a rank does in each phase, and every
exchange is a collective that all ranks enter in the same order (DESIGN §4). `RLRecipe.train` is the step:

  1. prompts     every rank draws the same prompts for batch b (seeded): nothing is sent
  2. rollout     each rollout engine generates n samples for its contiguous share of the prompts
  3. exchange    each engine's leader sends its responses (packed tokens + lengths) to the scoring ranks and
                 their sampling log-probs to the trained roles (rl_exchange: each message to its consumers)
  4. scoring     actor (old log-probs), critic (values), ref (log-probs) and reward models (scores) each work on
                 their contiguous shard; rule/remote rewards on one rank
  5. exchange    each role gathers its shard results to its leader, which sends them to the trained roles
  6. advantages  actor and critic ranks turn scores, KL and values into an `Experience` (one pure function,
                 `algorithms.advantages.assemble_advantages`)
  7. training    actor (clipped policy loss) and critic (clipped value loss) train at the same time, each on its
                 own group with DeepSpeed, through one mini-batch loop (`_train_role`)
  8. sync        the actor's leader streams the new weights to the rollout ranks in buckets, one module gathered
                 at a time (hybrid `rollout@actor`: the hf engine generates with the actor's own module)

Asynchronous RL (`rl.max_staleness` K >= 1, disjoint placements): at step t batch t, generated at most K policy
versions ago, is exchanged, then the engines generate batch t+K (phase 2 after 3) while phases 4-7 run on the
other ranks, and join the sync when done. The policy loss weights each token by the truncated importance weight
pi_old / pi_rollout (`rl.tis_cap`). The schedule, and the batches in flight in checkpoints: `rl_pipeline.py`.

No phase holds a whole model on a rank under ZeRO-3 (one module gathered at a time in forwards, engines/train.py;
weight sync streams, dist/weight_sync.py). Log-probs of the actor and the reference are those of the sampling
distribution softmax(logits / T), T the rollout temperature, as the engines report theirs: the PPO ratio and the
KL estimators are unbiased only then. Losses are means over the whole optimizer step (all its micro-batches and
ranks), not means of micro-batch means. The configuration lives in `rl_config.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf import rewards as reward_fns
from hpc_rlhf.algorithms.advantages import assemble_advantages
from hpc_rlhf.algorithms.kl import kl_estimate
from hpc_rlhf.algorithms.logprobs import entropy_from_logits, masked_sum
from hpc_rlhf.algorithms.losses import loss_normalizer, policy_loss, value_loss
from hpc_rlhf.config import ModelSection, TrainSection
from hpc_rlhf.data.synthetic import exact_match
from hpc_rlhf.dist import exchange, groups, watchdog, weight_sync
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.engines import deepspeed_compat
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.models.dropout import disable_dropout
from hpc_rlhf.models.value_model import build_value_model, sequence_scores, token_values
from hpc_rlhf.trainers import common
from hpc_rlhf.trainers.experience import (Experience, SampleBatch, from_ragged, make_batch, response_logprobs,
                                          shard_bounds, to_ragged)
from hpc_rlhf.trainers.reference import FrozenModel
from hpc_rlhf.trainers.rl_config import Config, check_plan_against_config, reward_role_names, tis_cap
from hpc_rlhf.trainers.rl_pipeline import RolloutPipeline, engine_generate, engine_led_here, share_generated
from hpc_rlhf.trainers.rl_roles import batch_rows, build_rollout_engine, hf_names, load_prompts, ranks_per_node
from hpc_rlhf.trainers.rl_scoring import rule_scores, sample_figures, score_on_shard, share_scores
from hpc_rlhf.utils import faults

log = logging.getLogger("hpc_rlhf")

CRITIC_FIGURES = ("value_loss", "value_clip_fraction", "critic_grad_norm", "critic_skipped")


class RLRecipe:
    def __init__(self, cfg: Config, mode: str = "ppo"):
        self.cfg = cfg
        self.mode = mode

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = common.start_run(cfg, self.mode)
        per_node = cfg.ranks_per_node or ranks_per_node(run.world_size)
        self.plan = plan = make_plan(cfg.placement, run.world_size, per_node)
        check_plan_against_config(plan, cfg)
        if run.is_main:
            log.info("placement:\n%s", plan.format_table())
        groups.initialize(plan, timeout_s=cfg.dist.timeout_s)
        common.ensure_tiny_assets_if_used(cfg.data.train_files, cfg.data.eval_files, cfg.actor.path)
        common.check_fits_model(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, cfg.actor.path,
                                "data.max_prompt_len + rollout.max_new_tokens")  # input validation up front
        self.tokenizer = load_tokenizer(cfg.actor.tokenizer or cfg.actor.path)
        self.prompts = load_prompts(cfg, self.tokenizer, cfg.data.train_files, "data.train_files",
                                    cfg.data.max_train_rows)
        self.eval_prompts = (load_prompts(cfg, self.tokenizer, cfg.data.eval_files, "data.eval_files",
                                          cfg.eval.max_rows) if cfg.data.eval_files else [])
        self.samples_per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples
        self.sampling = SamplingParams(n=cfg.rollout.n_samples, temperature=cfg.rollout.temperature,
                                       top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                       max_new_tokens=cfg.rollout.max_new_tokens)
        self.reward_roles = reward_role_names(len(cfg.reward.models))

        self.actor = self.critic = self.ref = self.rollout = None
        self.reward_models: dict[str, Any] = {}
        if groups.has_role("actor"):
            actor = build_causal_lm(cfg.actor)
            disable_dropout(actor)  # old and new log-probs must come from the same network (models/dropout.py)
            self.actor = TrainEngine(actor, self._engine_train_cfg(cfg.train), group=groups.role_group("actor"),
                                     model_dtype=cfg.actor.dtype)
        if groups.has_role("critic"):
            critic = build_value_model(cfg.critic, fold_normalization=cfg.reward.normalize)
            disable_dropout(critic)
            self.critic = TrainEngine(critic, self._engine_train_cfg(cfg.critic_train),
                                      group=groups.role_group("critic"), model_dtype=cfg.critic.dtype)
        # Frozen roles: whole on each rank, or sharded over their role's ranks under train.zero_stage=3.
        if groups.has_role("ref"):
            ref_cfg = dataclasses.replace(cfg.actor, path=cfg.ref_path or cfg.actor.path,
                                          lora=dataclasses.replace(cfg.actor.lora, rank=0))
            self.ref = FrozenModel(ref_cfg, cfg.train, run.device, group=groups.role_group("ref"))
        for name, path in zip(self.reward_roles, cfg.reward.models):
            if groups.has_role(name):
                self.reward_models[name] = FrozenModel(ModelSection(path=path, dtype=cfg.actor.dtype), cfg.train,
                                                       run.device, group=groups.role_group(name),
                                                       build=build_value_model)
        self.rule_functions = [(spec, reward_fns.load_reward_function(spec)) for spec in cfg.reward.functions]
        self.rule_leader = groups.role_leader(self.reward_roles[0] if self.reward_roles else "actor")
        if groups.has_role("rollout"):
            self.rollout = build_rollout_engine(cfg, plan, self.tokenizer, run.device, actor=self.actor)

        state = common.resume_if_possible(run, self._my_engines())
        if run.start_step > 0 and not plan.is_hybrid:
            self._sync_weights()  # the engines start from the initial weights: give them the resumed ones
        self.pipeline = RolloutPipeline(cfg.rl.max_staleness, cfg.train.max_steps, engine_led_here())
        self.pipeline.restore(run.extra.get("resumed_from"), state)  # batches in flight at the checkpoint
        self.stop = common.StopSignal()
        self.bad_steps = common.NonFiniteGuard(cfg.train.max_bad_steps, self.mode)
        common.open_logger(run, cfg.train.max_steps)

    def _engine_train_cfg(self, train: TrainSection) -> TrainSection:
        """The engine counts optimizer steps: several per RL step (ppo_epochs x samples / batch_size)."""
        updates = self.cfg.rl.ppo_epochs * (self.samples_per_step // train.batch_size)
        return dataclasses.replace(train, max_steps=train.max_steps * updates,
                                   warmup_steps=train.warmup_steps * updates)

    def _my_engines(self) -> dict:
        return {name: engine for name, engine in (("actor", self.actor), ("critic", self.critic)) if engine}

    # -------------------------------------------------------------------------------------------- the step
    def train(self) -> dict[str, float]:
        cfg, run = self.cfg, self.run
        result = {}
        if run.start_step == 0 and cfg.log.eval_every_steps > 0:
            with watchdog.phase("eval"):  # failure handling: each phase of the loop is named for the watchdog
                result["eval_accuracy"] = self.evaluate()
            run.logger.log(0, {"eval_accuracy": result["eval_accuracy"]})
        watchdog.set_step(run.start_step + 1)
        for index in self.pipeline.to_prefill(run.start_step):  # asynchronous RL: the first K batches
            self._rollout(index, version=run.start_step, phase="rollout_prefill")
        for step in range(run.start_step, cfg.train.max_steps):
            watchdog.set_step(step + 1)
            t0 = time.perf_counter()
            # 1-2. prompts (the same on every rank) and rollout: with K = rl.max_staleness = 0, this step's batch now
            if self.pipeline.max_staleness == 0:
                self._rollout(step, version=step)
            # 3. exchange: this step's batch (with K >= 1 generated earlier, at most K versions ago)
            batch, responses, rollout_logps, staleness = self._exchange(step)
            t_generate = time.perf_counter()
            # 2'. K >= 1: the engines generate batch step + K from this step's weights while 4-7 run elsewhere
            if self.pipeline.ahead_of(step) is not None:
                self._rollout(self.pipeline.ahead_of(step), version=step)
            # 4-5. scoring and exchange
            with watchdog.phase("scoring"):
                scored = self._score(batch, self._prompts_of(step), responses)
            t_score = time.perf_counter()
            # 6-7. advantages and training, actor and critic at the same time on their own ranks
            metrics: dict[str, float] = {}
            critic_figures: dict[str, float] = {}
            with watchdog.phase("training"):
                if self.actor is not None or self.critic is not None:
                    exp = self._experience(batch, scored, rollout_logps)
                    if self.actor is not None:
                        metrics.update(self._train_actor(step, exp))
                    if self.critic is not None:
                        critic_figures = self._train_critic(step, exp)
            t_train = time.perf_counter()
            # 8. weight sync
            with watchdog.phase("weight_sync"):
                sync_mb = self._sync_weights()
            t_sync = time.perf_counter()
            metrics.update(self._critic_figures_to_logger(critic_figures))
            done = step + 1

            # A non-finite step of either trained role counts (each role's ranks skipped it together).
            skipped = bool(metrics.get("actor_skipped", 0.0)) or bool(critic_figures.get("critic_skipped", 0.0))
            self.bad_steps.update(_any_rank(skipped), done)
            if run.is_main:  # rank 0 is the actor's leader: it holds the whole Experience
                metrics.update(sample_figures(exp, cfg.rl.kl_estimator, "ref" in scored, tis_cap(cfg.rl)))
                elapsed = t_sync - t0
                metrics.update({
                    "time_generate": t_generate - t0, "time_score": t_score - t_generate,
                    "time_train": t_train - t_score, "time_sync": t_sync - t_train, "time_step": elapsed,
                    "samples_per_s": len(responses) / max(elapsed, 1e-9), "weight_sync_mb": sync_mb,
                    "skipped_steps": self.bad_steps.total, "staleness": staleness,
                })
            if cfg.log.eval_every_steps and (done % cfg.log.eval_every_steps == 0 or done == cfg.train.max_steps):
                with watchdog.phase("eval"):
                    metrics["eval_accuracy"] = result["eval_accuracy"] = self.evaluate()
            if done % cfg.log.every_steps == 0 or "eval_accuracy" in metrics:
                run.logger.log(done, metrics)
            run.logger.advance()
            common.checkpoint_or_stop(run, done, self._my_engines(), self.stop, cfg.train.max_steps,
                                      save_extra=self.pipeline.save)  # the batches in flight go with it
        with watchdog.phase("checkpoint"):
            if self.actor is not None:
                common.save_final_model(self.actor, run.output_dir / "final", self.tokenizer, cfg.actor.lora)
            if self.critic is not None:
                common.save_final_model(self.critic, run.output_dir / "final_critic", self.tokenizer,
                                        cfg.critic.lora)
        dist.barrier()
        run.logger.close()
        return result

    # ------------------------------------------------------------------------------------------ phase 1-3
    def _prompts_of(self, index: int) -> list[dict]:
        """The prompts of batch `index`, the same on every rank (seeded)."""
        rows = batch_rows(len(self.prompts), self.cfg.rollout.prompts_per_step, index, self.cfg.train.seed)
        return [self.prompts[i] for i in rows]

    def _rollout(self, index: int, version: int, phase: str = "rollout") -> None:
        """The engines generate batch `index` with the weights they hold (policy `version`); each engine's first
        rank keeps its share until the batch's exchange. Every rank calls it (the others only note the version)."""
        sampling = dataclasses.replace(self.sampling, seed=self.cfg.train.seed * 100003 + index)
        with watchdog.phase(phase):
            mine, mine_logps = engine_generate(self.rollout, [p["input_ids"] for p in self._prompts_of(index)],
                                               sampling, self._engine_awake)
        self.pipeline.put(index, version, mine, mine_logps)

    def _exchange(self, index: int):
        """Batch `index` leaves the pipeline: (padded batch, responses, sampling log-probs (B, T-1)) where known,
        else None; and the batch's staleness in policy versions."""
        rollout = self.cfg.rollout
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            responses, logps, staleness = self.pipeline.exchange(index, len(self._prompts_of(index)),
                                                                 rollout.n_samples, rollout.max_new_tokens)
        if responses is None:  # ranks that consume no responses (rollout-only ranks)
            return None, None, None, staleness
        batch = make_batch(self._per_sample(self._prompts_of(index), "input_ids"), responses,
                           self.tokenizer.pad_token_id)
        return batch, responses, from_ragged(logps, batch) if logps is not None else None, staleness

    def _per_sample(self, prompts: list[dict], key: str) -> list:
        return [p[key] for p in prompts for _ in range(self.cfg.rollout.n_samples)]

    @contextlib.contextmanager
    def _engine_awake(self):
        """A hybrid vLLM engine (its own weights, its own processes) sleeps while the actor trains: stream the actor's
        weights in when they changed since it last got them (one module gathered at a time under ZeRO-3, on every
        actor rank), wake it, generate, put it back to sleep (a no-op on CPU)."""
        if not (self.plan.is_hybrid and self.cfg.rollout.backend == "vllm"):
            yield
            return
        version = (self.actor.global_step, self.actor.skipped_steps)
        if version != getattr(self, "_vllm_weights_version", None):
            weights = hf_names(self.actor.full_state(on_every_rank=True))
            if self.rollout is None:  # a vLLM engine's other ranks take part in the gathers only
                for _ in weights:
                    pass
            else:
                weight_sync.load_local_weights(weights, self.rollout.load_weights,
                                               bucket_mb=self.cfg.rollout.weight_sync_bucket_mb)
            self._vllm_weights_version = version
        if self.rollout is None:
            yield
            return
        self.rollout.wake()
        try:
            yield
        finally:
            self.rollout.sleep()

    # ------------------------------------------------------------------------------------------ phase 4-5
    @torch.no_grad()
    def _score(self, batch: SampleBatch, step_prompts: list[dict], responses) -> dict[str, torch.Tensor]:
        """Each scoring role on its shard, then every role's results on the trained roles' ranks, dense: (B, T-1)
        per-token tensors for actor, critic and ref, (B,) scores of each reward model and "rules" (rule/remote)."""
        cfg, device = self.cfg, self.run.device
        sample_prompts = self._per_sample(step_prompts, "input_ids")
        temperature = self.sampling.logprob_temperature
        samples, micro = self.samples_per_step, cfg.train.micro_batch_size

        def logps_of(model):
            def one(sub):
                logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask, use_cache=False).logits
                return to_ragged(response_logprobs(logits.float(), sub, temperature), sub)
            return one

        def values_of(model):
            def one(sub):
                return to_ragged(token_values(model, sub.input_ids, sub.attention_mask)[:, :-1].float(), sub)
            return one

        def scores_of(model):
            def one(sub):
                scores = sequence_scores(model, sub.input_ids, sub.attention_mask, normalize=cfg.reward.normalize)
                return [v.reshape(1).float().cpu() for v in scores]
            return one

        def batch_of(start, end):
            return make_batch(sample_prompts[start:end], responses[start:end], self.tokenizer.pad_token_id).to(device)

        # The trained roles score through their module's forward: under ZeRO-3 its hooks fetch one layer at a
        # time, as for the frozen roles (never the whole model at once).
        local: dict[str, list | None] = {}
        if self.actor is not None:
            local["actor"] = score_on_shard("actor", samples, micro, batch_of, logps_of(self.actor.module))
        if self.critic is not None:
            local["critic"] = score_on_shard("critic", samples, micro, batch_of, values_of(self.critic.module))
        if self.ref is not None:
            with deepspeed_compat.keep_collectives_in_group(self.ref.group):
                local["ref"] = score_on_shard("ref", samples, micro, batch_of, logps_of(self.ref.model))
        for name, frozen in self.reward_models.items():
            with deepspeed_compat.keep_collectives_in_group(frozen.group):
                local[name] = score_on_shard(name, samples, micro, batch_of, scores_of(frozen.model))

        with_rules, rules = bool(self.rule_functions or cfg.reward.http_url), None
        if with_rules:
            rules = rule_scores(cfg, self.rule_functions, self.tokenizer, self.rule_leader,
                                self._per_sample(step_prompts, "text"), responses,
                                self._per_sample(step_prompts, "answer"))
        roles = [r for r in ["actor", "critic", "ref", *self.reward_roles] if self.plan.has(r)]
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            return share_scores(local, roles, rules, with_rules, batch)

    # -------------------------------------------------------------------------------------------- phase 6
    def _experience(self, batch: SampleBatch, scored: dict[str, torch.Tensor],
                    rollout_logps: torch.Tensor) -> Experience:
        cfg, rl = self.cfg, self.cfg.rl
        old_logps = scored["actor"]
        assembled = assemble_advantages(
            scored["rules"], [scored[name] for name in self.reward_roles],
            cfg.reward.model_weights or [1.0] * len(self.reward_roles), old_logps, scored.get("ref"),
            batch.action_mask, kl_estimator=rl.kl_estimator, estimator=rl.advantage, n=cfg.rollout.n_samples,
            kl_coef=rl.kl_coef, kl_in_reward=rl.kl_in_reward, gamma=rl.gamma, lam=rl.lam, values=scored.get("critic"),
            whiten=rl.whiten_advantages, normalize_scores=rl.normalize_rewards, score_clip=cfg.reward.clip)
        return Experience(batch, assembled.scores, rollout_logps, old_logps, scored.get("ref", old_logps), assembled.kl,
                          assembled.advantages, scored.get("critic"), assembled.returns)

    # -------------------------------------------------------------------------------------------- phase 7
    def _train_actor(self, step: int, exp: Experience) -> dict[str, float]:
        rl, cap = self.cfg.rl, tis_cap(self.cfg.rl)

        def loss_of(micro: Experience, tokens: float, policy_normalizer: float):
            mask = micro.batch.action_mask
            logits = self.actor(input_ids=micro.batch.input_ids, attention_mask=micro.batch.attention_mask,
                                use_cache=False).logits.float()
            logps = response_logprobs(logits, micro.batch, self.sampling.logprob_temperature)
            weights = None
            if cap is not None:  # truncated importance sampling: the batch's behaviour policy is the engine's
                weights = torch.exp(micro.old_logps - micro.rollout_logps).clamp(max=cap)
            policy, clip_fraction, approx_kl = policy_loss(
                logps, micro.old_logps, micro.advantages, mask, clip_eps=rl.clip_eps, clip_eps_high=rl.clip_eps_high,
                dual_clip=rl.dual_clip, loss_agg=rl.loss_agg, normalizer=policy_normalizer, token_weights=weights)
            share = sum(micro.batch.response_lens) / tokens  # its part of the step's token means (no host sync)
            with torch.set_grad_enabled(rl.entropy_coef > 0):
                entropy = masked_sum(entropy_from_logits(logits[:, :-1] / self.sampling.logprob_temperature), mask)
            loss = policy - rl.entropy_coef * entropy / tokens
            figures = {"policy_loss": policy.detach(), "entropy": entropy.detach() / tokens,
                       "clip_fraction": clip_fraction * share, "approx_kl": approx_kl * share}
            if rl.kl_coef > 0 and not rl.kl_in_reward:
                kl = masked_sum(kl_estimate(logps, micro.ref_logps, kind=rl.kl_estimator), mask) / tokens
                loss = loss + rl.kl_coef * kl
                figures["kl_loss"] = kl.detach()
            return loss, figures

        return self._train_role("actor", self.actor, self.cfg.train, step, exp, loss_of, seed_offsets=(31, 7))

    def _train_critic(self, step: int, exp: Experience) -> dict[str, float]:
        clip = self.cfg.rl.value_clip_eps

        def loss_of(micro: Experience, tokens: float, policy_normalizer: float):
            mask = micro.batch.action_mask
            values = token_values(self.critic.module, micro.batch.input_ids, micro.batch.attention_mask)[:, :-1]
            loss, clip_fraction = value_loss(values.float(), micro.values, micro.returns, mask, clip_eps=clip,
                                             normalizer=tokens)
            share = sum(micro.batch.response_lens) / tokens
            return loss, {"value_loss": loss.detach(), "value_clip_fraction": clip_fraction * share}

        return self._train_role("critic", self.critic, self.cfg.critic_train, step, exp, loss_of,
                                seed_offsets=(37, 11))

    def _train_role(self, role: str, engine: TrainEngine, train: TrainSection, step: int, exp: Experience,
                    loss_of, seed_offsets: tuple[int, int]) -> dict[str, float]:
        """PPO's mini-batch loop for one trained role: `ppo_epochs` passes over the step's samples in a seeded
        order, one optimizer step per `train.batch_size` samples, each rank of the role taking its contiguous
        share in micro-batches.

        `loss_of(micro, tokens, policy_normalizer)` returns (loss, figures) where the loss and each figure are
        this micro-batch's part of a mean over the optimizer step's `tokens` response tokens (or its
        `policy_normalizer` sequences or tokens, for the policy loss): summed over the step's micro-batches and
        ranks they are that mean. DeepSpeed divides each backward by the accumulation steps and averages the
        gradients over the role's ranks, so the loss is scaled back by both before backward. Figures stay
        tensors until the end: one host transfer and one all-reduce per RL step.
        """
        rl = self.cfg.rl
        size, index = len(groups.role_ranks(role)), groups.rank_in_role(role)
        gradient_scale = engine.gradient_accumulation_steps * size
        sums: dict[str, torch.Tensor] = {}
        infos, updates = [], 0
        for epoch in range(rl.ppo_epochs):
            seed = train.seed * seed_offsets[0] + step * seed_offsets[1] + epoch
            order = torch.randperm(len(exp), generator=torch.Generator().manual_seed(seed))
            for start in range(0, len(exp), train.batch_size):
                chosen = order[start:start + train.batch_size].tolist()
                chosen_mask = exp.batch.action_mask[chosen]
                tokens = max(float(chosen_mask.sum()), 1.0)
                policy_normalizer = loss_normalizer(chosen_mask, rl.loss_agg)
                lo, hi = shard_bounds(len(chosen), size, index)
                mine = chosen[lo:hi]
                for m in range(0, len(mine), train.micro_batch_size):
                    micro = exp.select(mine[m:m + train.micro_batch_size], device=self.run.device)
                    loss, figures = loss_of(micro, tokens, policy_normalizer)
                    loss = faults.poison(loss, step + 1)  # failure handling: HPC_RLHF_FAULT kind=nan
                    engine.backward(loss * gradient_scale)
                    infos.append(engine.step())
                    for key, value in figures.items():
                        sums[key] = sums.get(key, 0.0) + value.detach().double()
                updates += 1
        keys = sorted(sums)
        device = exchange.comm_device(groups.role_group(role))
        totals = torch.stack([sums[k].to(device) for k in keys]) if keys else torch.zeros(0, device=device)
        dist.all_reduce(totals, group=groups.role_group(role))
        out = dict(zip(keys, (totals / updates).tolist()))
        stepped = [i for i in infos if i.stepped]
        out[f"{role}_grad_norm"] = stepped[-1].grad_norm if stepped else float("nan")
        out[f"{role}_lr"] = stepped[-1].lr if stepped else engine.lr
        out[f"{role}_skipped"] = float(any(i.skipped for i in stepped))
        return out

    def _critic_figures_to_logger(self, figures: dict[str, float]) -> dict[str, float]:
        """The critic's figures, from its leader to rank 0, which logs them ({} on the other ranks)."""
        leader = groups.role_leader("critic") if self.plan.has("critic") else None
        if dist.get_rank() not in (leader, groups.LOGGING_RANK) or leader is None:
            return {}
        values = torch.tensor([figures.get(k, float("nan")) for k in CRITIC_FIGURES], dtype=torch.float64)
        if leader != groups.LOGGING_RANK:
            if dist.get_rank() == leader:
                exchange.send_known(values, groups.LOGGING_RANK, len(CRITIC_FIGURES), torch.float64, tag="critic")
                return {}
            values = exchange.recv_known(leader, len(CRITIC_FIGURES), torch.float64)
        return dict(zip(CRITIC_FIGURES[:-1], values.tolist()))

    # -------------------------------------------------------------------------------------------- phase 8
    def _sync_weights(self) -> float:
        """Actor leader -> every rollout rank, streamed in buckets. Returns megabytes sent (at the leader)."""
        if self.plan.is_hybrid:
            return 0.0
        sent = 0.0
        src = groups.role_leader("actor")
        if self.actor is not None:
            # every actor rank takes part in the gathers; the leader sends each module as it comes
            weights = hf_names(self.actor.full_state())
            if dist.get_rank() == src:
                stats = weight_sync.send_weights(weights, src=src, group=groups.weight_sync_group(),
                                                 bucket_mb=self.cfg.rollout.weight_sync_bucket_mb, reuse_layout=True)
                sent = stats.bytes / 2**20
            else:
                for _ in weights:
                    pass
        if groups.has_role("rollout"):  # a vLLM engine's other ranks hold no engine (None): they drop the data
            weight_sync.receive_into(self.rollout, src=src, group=groups.weight_sync_group())
        return float(sent)

    # -------------------------------------------------------------------------------------------- eval
    def evaluate(self) -> float:
        """Greedy held-out exact match, the rollout engines sharing the prompts (on rank 0; nan elsewhere)."""
        if not self.eval_prompts:
            return float("nan")
        sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.cfg.eval.max_new_tokens)
        mine, _ = engine_generate(self.rollout, [p["input_ids"] for p in self.eval_prompts], sampling,
                                  self._engine_awake)
        with watchdog.phase("exchange"):
            responses, _ = share_generated(mine, None, "eval", len(self.eval_prompts), 1, sampling.max_new_tokens)
        if responses is None:  # only rank 0 gets the responses, decodes and logs the figure
            return float("nan")
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in responses]
        correct = sum(exact_match(t, p["answer"]) for t, p in zip(texts, self.eval_prompts) if p["answer"] is not None)
        return correct / max(1, sum(p["answer"] is not None for p in self.eval_prompts))


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=exchange.comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def run(cfg: Config, mode: str = "ppo") -> dict[str, float]:
    recipe = RLRecipe(cfg, mode)
    recipe.setup()
    return recipe.train()
