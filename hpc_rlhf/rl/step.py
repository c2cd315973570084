"""`hpc-rlhf ppo` and `hpc-rlhf grpo`: RL from rewards with every role on its own process group. `RLRecipe.train`
is the step; read it top to bottom. Each phase is one module of this package:

  1. prompts     roles.py       every rank draws the same prompts for batch b (seeded): nothing is sent
  2. rollout     rollout.py     each rollout engine generates n samples for its contiguous share of the prompts
  3. exchange    messages.py    each engine's leader sends its responses (packed tokens + lengths) and their
                                sampling log-probs to the ranks that consume them (the route table)
  4. scoring     scoring.py     actor (old log-probs), critic (values), ref (log-probs) and reward models (scores)
                                each on their contiguous shard; rule/remote rewards on one rank
  5. exchange    messages.py    each role gathers its shard results to its leader, which sends them on
  6. advantages  experience.py  actor and critic ranks turn scores, KL and values into an `Experience` (one pure
                                function, `algorithms.advantages.assemble_advantages`)
  7. training    training.py    actor (clipped policy loss) and critic (clipped value loss), at the same time, each
                                on its own group with DeepSpeed
  8. sync        sync.py        the actor's leader streams the new weights (a LoRA actor: its adapter alone) to the
                                rollout ranks in buckets
     rounds      dynamic_sampling.py  (rl.dynamic_sampling) 2-5 again until the batch holds prompts with signal
     logging     metrics.py     what rank 0 logs about the step
     config      config.py      the keys, and the checks that run before any rank starts

Every rank runs this same loop; `groups.has_role(...)` decides what a rank does in each phase, and every exchange
is a collective or point-to-point message that all its ranks enter in the same order (DESIGN §4).

Asynchronous RL (`rl.max_staleness` K >= 1, disjoint placements): at step t batch t, generated at most K policy
versions ago, is exchanged, then the engines generate batch t+K (phase 2 after 3) while phases 4-7 run on the
other ranks, and join the sync when done. The policy loss weights each token by the truncated importance weight
pi_old / pi_rollout (`rl.is_correction`, `rl.tis_cap`). The schedule, and the batches in flight in checkpoints:
rollout.py.

LoRA (`actor.lora.rank > 0`): the engines hold the frozen base and each sync moves the adapter alone (sync.py);
with `ref_mode=adapter_disabled` (the default for a LoRA actor, config.py) the reference is the actor itself with
its adapter off: no `ref` role, no second copy; the actor's ranks score it in phase 4 and its leader sends it.

No phase holds a whole model on a rank under ZeRO-3 (one module gathered at a time in forwards, engines/train.py;
weight sync streams, dist/weight_sync.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch.distributed as dist

from hpc_rlhf import rewards as reward_fns
from hpc_rlhf.config import ModelSection, TrainSection
from hpc_rlhf.data.synthetic import exact_match
from hpc_rlhf.dist import groups, watchdog
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.models.dropout import disable_dropout
from hpc_rlhf.models.value_model import build_value_model
from hpc_rlhf.rl import episodes, messages, scoring
from hpc_rlhf.rl.config import Config, check_plan_against_config, is_correction, reference_mode, reward_role_names
from hpc_rlhf.rl.dynamic_sampling import Rounds, agree_on_more, round_seed
from hpc_rlhf.rl.experience import SampleBatch, build_experience, from_ragged, make_batch
from hpc_rlhf.rl.metrics import sample_figures, step_timing
from hpc_rlhf.rl.roles import batch_rows, build_rollout_engine, load_prompts, ranks_per_node
from hpc_rlhf.rl.rollout import RolloutPipeline, batch_seed, engine_generate, engine_led_here
from hpc_rlhf.rl.sync import WeightSync
from hpc_rlhf.rl.training import train_actor, train_critic
from hpc_rlhf.runtime import checkpointing
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.reference import FrozenModel

log = logging.getLogger("hpc_rlhf")


class RLRecipe:
    def __init__(self, cfg: Config, mode: str = "ppo"):
        self.cfg = cfg
        self.mode = mode

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, self.mode)
        per_node = cfg.ranks_per_node or ranks_per_node(run.world_size)
        self.plan = plan = make_plan(cfg.placement, run.world_size, per_node)
        check_plan_against_config(plan, cfg)
        if plan.role("actor").leader != messages.LOGGING_RANK:  # the logging rank must hold the step's Experience
            raise RuntimeError(f"rank {messages.LOGGING_RANK} logs the step but the actor's leader is rank "
                               f"{plan.role('actor').leader}\n{plan.format_table()}")
        if run.is_main:
            log.info("placement:\n%s", plan.format_table())
        # LoRA with ref_mode=adapter_disabled: the actor's ranks compute the reference, its leader sends it
        self.ref_from_actor = reference_mode(cfg) == "adapter_disabled" and cfg.rl.kl_coef > 0
        ref_role = "actor" if self.ref_from_actor else "ref"
        messages.set_reference_role(ref_role)
        groups.initialize(plan, messages.message_groups(plan, ref_role), timeout_s=cfg.dist.timeout_s)
        run_setup.ensure_tiny_assets_if_used(cfg.data.train_files, cfg.data.eval_files, cfg.actor.path)
        longest = ("env.max_episode_tokens", cfg.env.max_episode_tokens) if cfg.env.enabled else \
            ("rollout.max_new_tokens", cfg.rollout.max_new_tokens)
        run_setup.check_fits_model(cfg.data.max_prompt_len + longest[1], cfg.actor.path,
                                   f"data.max_prompt_len + {longest[0]}")  # input validation up front
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
            actor = build_causal_lm(cfg.actor, where="actor")
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
            # built for inference: no adapter (a QLoRA actor's reference keeps the 4-bit base, as the actor's)
            ref_cfg = dataclasses.replace(cfg.actor, path=cfg.ref_path or cfg.actor.path)
            self.ref = FrozenModel(ref_cfg, cfg.train, run.device, group=groups.role_group("ref"))
        for name, path in zip(self.reward_roles, cfg.reward.models):
            if groups.has_role(name):
                self.reward_models[name] = FrozenModel(ModelSection(path=path, dtype=cfg.actor.dtype), cfg.train,
                                                       run.device, group=groups.role_group(name),
                                                       build=build_value_model)
        self.rule_functions = [(spec, reward_fns.load_reward_function(spec)) for spec in cfg.reward.functions]
        self.rule_leader = messages.rule_reward_rank(plan)
        if groups.has_role("rollout"):
            self.rollout = build_rollout_engine(cfg, plan, self.tokenizer, run.device, actor=self.actor)
        self.weights = WeightSync(plan, self.actor, self.rollout, cfg.rollout.backend,
                                  cfg.rollout.weight_sync_bucket_mb, adapter_only=cfg.actor.lora.rank > 0)
        # multi-turn episodes (env.name, env.http_url): played where generation runs (rl/episodes.py)
        self.play = (episodes.EpisodePlayer(cfg.env, self.tokenizer, cfg.data.apply_chat_template)
                     if cfg.env.enabled and engine_led_here() is not None else None)
        self.max_response_tokens = cfg.env.max_episode_tokens if cfg.env.enabled else cfg.rollout.max_new_tokens

        state = checkpointing.resume_if_possible(run, self._my_engines())
        if run.start_step > 0 and not plan.is_hybrid:
            self.weights.sync()  # the engines start from the initial weights: give them the resumed ones
        self.pipeline = RolloutPipeline(cfg.rl.max_staleness, cfg.train.max_steps, engine_led_here())
        self.pipeline.restore(run.extra.get("resumed_from"), state)  # batches in flight at the checkpoint
        self.stop = checkpointing.StopSignal()
        self.bad_steps = checkpointing.NonFiniteGuard(cfg.train.max_bad_steps, self.mode)
        run_setup.open_logger(run, cfg.train.max_steps)

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
                result.update(self.evaluate())
            run.logger.log(0, dict(result))
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
            batch, generated, rollout_logps, staleness = self._exchange(step)
            t_generate = time.perf_counter()
            # 2'. K >= 1: the engines generate batch step + K from this step's weights while 4-7 run elsewhere
            if self.pipeline.ahead_of(step) is not None:
                self._rollout(self.pipeline.ahead_of(step), version=step)
            # 4-5. scoring and exchange
            with watchdog.phase("scoring"):
                scored = self._score(batch, self._prompts_of(step), generated)
            episode_figures = self._episode_figures(generated)
            # 2-5 again (rl.dynamic_sampling): further rounds until the batch holds only prompts that carry signal
            keep_samples, round_figures = None, {}
            if cfg.rl.dynamic_sampling:
                batch, generated, rollout_logps, scored, keep_samples, round_figures = self._fill_from_rounds(
                    step, batch, generated, rollout_logps, scored)
            t_score = time.perf_counter()
            # 6-7. advantages and training, actor and critic at the same time on their own ranks
            metrics: dict[str, float] = {}
            critic_figures: dict[str, float] = {}
            exp = None
            with watchdog.phase("training"):
                if self.actor is not None or self.critic is not None:
                    exp, assembly_figures = build_experience(cfg, batch, scored, rollout_logps, self.reward_roles,
                                                             self.tokenizer.eos_token_id, keep_samples,
                                                             episodes.truncated(generated))
                    if self.actor is not None:
                        metrics.update(train_actor(self.actor, cfg, step, exp, run.device,
                                                   self.sampling.logprob_temperature))
                    if self.critic is not None:
                        critic_figures = train_critic(self.critic, cfg, step, exp, run.device)
            t_train = time.perf_counter()
            # 8. weight sync
            with watchdog.phase("weight_sync"):
                sync_mb = self.weights.sync()
            t_sync = time.perf_counter()
            metrics.update(messages.critic_figures_to_logger(critic_figures))
            done = step + 1

            # A non-finite step of either trained role counts (each role's ranks skipped it together); a stop
            # signal on any rank stops every rank after this step: both agreed in one all-reduce.
            skipped = bool(metrics.get("actor_skipped", 0.0)) or bool(critic_figures.get("critic_skipped", 0.0))
            skipped, stopping = run_setup.any_rank([skipped, self.stop.received is not None])
            self.bad_steps.update(skipped, done)
            if dist.get_rank() == messages.LOGGING_RANK:  # the actor's leader (checked in setup): it holds `exp`
                mode, params = is_correction(cfg.rl)
                metrics.update(sample_figures(exp, cfg.rl.kl_estimator, "ref" in scored,
                                              params["cap"] if mode == "tis_token" else None))
                metrics.update(assembly_figures)
                metrics.update(round_figures)
                metrics.update(episode_figures)
                metrics.update(step_timing(t0, t_generate, t_score, t_train, t_sync, len(generated)))
                metrics.update({"weight_sync_mb": sync_mb, "skipped_steps": self.bad_steps.total,
                                "staleness": staleness})
            if cfg.log.eval_every_steps and (done % cfg.log.eval_every_steps == 0 or done == cfg.train.max_steps):
                with watchdog.phase("eval"):
                    result.update(self.evaluate())
                metrics.update(result)
            if done % cfg.log.every_steps == 0 or "eval_accuracy" in metrics:
                run.logger.log(done, metrics)
            run.logger.advance()
            checkpointing.checkpoint_or_stop(run, done, self._my_engines(), stopping, cfg.train.max_steps,
                                             save_extra=self.pipeline.save)  # the batches in flight go with it
        with watchdog.phase("checkpoint"):
            if self.actor is not None:
                checkpointing.save_final_model(self.actor, run.output_dir / "final", self.tokenizer, cfg.actor.lora)
            if self.critic is not None:
                checkpointing.save_final_model(self.critic, run.output_dir / "final_critic", self.tokenizer,
                                               cfg.critic.lora)
        dist.barrier()
        run.logger.close()
        return result

    # ------------------------------------------------------------------------------------------ phase 1-3
    def _prompts_of(self, index: int, round_index: int = 0) -> list[dict]:
        """The prompts of batch `index` (of its dynamic-sampling round `round_index`), the same on every rank
        (seeded)."""
        rows = batch_rows(len(self.prompts), self.cfg.rollout.prompts_per_step, index, self.cfg.train.seed,
                          round_index)
        return [self.prompts[i] for i in rows]

    def _per_sample(self, prompts: list[dict], key: str) -> list:
        return [p[key] for p in prompts for _ in range(self.cfg.rollout.n_samples)]

    def _rollout(self, index: int, version: int, phase: str = "rollout") -> None:
        """The engines generate batch `index` with the weights they hold (policy `version`); each engine's first
        rank keeps its share until the batch's exchange. Every rank calls it (the others only note the version)."""
        sampling = dataclasses.replace(self.sampling, seed=batch_seed(self.cfg.train.seed, index))
        with watchdog.phase(phase):
            share = engine_generate(self.rollout, self._prompts_of(index), sampling, self.weights.engine_awake,
                                    self.play)
        self.pipeline.put(index, version, share)

    def _exchange(self, index: int):
        """Batch `index` leaves the pipeline and travels: (padded batch, what the engines generated, sampling
        log-probs (B, T-1)) where they are consumed, else None; and the batch's staleness in policy versions."""
        share, staleness = self.pipeline.take(index)
        return (*self._share(share, self._prompts_of(index)), staleness)

    def _share(self, share, prompts: list[dict]):
        """The engines' shares of a batch of `prompts` to the ranks that consume them: (batch, generated, sampling
        log-probs (B, T-1)) there, Nones elsewhere (rollout-only ranks)."""
        rollout = self.cfg.rollout
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            generated = messages.share_generated(share, "responses", len(prompts), rollout.n_samples,
                                                 self.max_response_tokens, with_logprobs=True,
                                                 with_episodes=self.cfg.env.enabled)
        if generated is None:
            return None, None, None
        batch = make_batch(self._per_sample(prompts, "input_ids"), generated.responses, self.tokenizer.pad_token_id,
                           generated.masks)
        return batch, generated, from_ragged(generated.logprobs, batch)

    def _episode_figures(self, generated) -> dict[str, float]:
        """The figures of a batch's episodes, on the logging rank (which gets every engine's share)."""
        if not self.cfg.env.enabled or dist.get_rank() != messages.LOGGING_RANK:
            return {}
        return episodes.episode_figures(generated)

    def _fill_from_rounds(self, step: int, batch, generated, rollout_logps, scored):
        """Dynamic sampling (rl/dynamic_sampling.py): round 0 is the step's batch as exchanged and scored; while the
        logging rank finds the batch short of prompts that carry signal, the engines generate another round with
        the weights they hold, which is exchanged and scored like the first. Every rank takes part in every round.
        Returns the batch to train on (batch, generated, sampling log-probs, scores, keep_samples) and the figures
        (on the trained ranks; what every other rank passed in, and None, {} elsewhere)."""
        cfg = self.cfg
        trained = self.actor is not None or self.critic is not None
        rounds = Rounds(cfg, self.reward_roles) if trained else None
        if trained:
            rounds.add(self._per_sample(self._prompts_of(step), "input_ids"), generated, batch, rollout_logps, scored)
        for round_index in range(1, cfg.rl.dynamic_sampling_max_rounds):
            more = None if rounds is None else not rounds.full()
            if not agree_on_more(more, messages.LOGGING_RANK):
                break
            prompts = self._prompts_of(step, round_index)
            sampling = dataclasses.replace(self.sampling, seed=round_seed(cfg.train.seed, step, round_index))
            with watchdog.phase("rollout"):
                share = engine_generate(self.rollout, prompts, sampling, self.weights.engine_awake, self.play)
            round_batch, round_generated, round_logps = self._share(share, prompts)
            with watchdog.phase("scoring"):
                round_scored = self._score(round_batch, prompts, round_generated)
            if trained:
                rounds.add(self._per_sample(prompts, "input_ids"), round_generated, round_batch, round_logps,
                           round_scored)
        if not trained:
            return batch, generated, rollout_logps, scored, None, {}
        batch, generated, rollout_logps, scored, keep = rounds.assemble(self.tokenizer.pad_token_id)
        return batch, generated, rollout_logps, scored, keep, rounds.figures()

    # ------------------------------------------------------------------------------------------ phase 4-5
    def _score(self, batch: SampleBatch, step_prompts: list[dict], generated) -> dict:
        """Each scoring role on its shard, then every role's results on the trained roles' ranks, dense: (B, T-1)
        per-token tensors for actor, critic and ref, (B,) scores of each reward model and "rules" (rule/remote, and
        with episodes the environment's reward, weighted by env.reward_weight)."""
        responses = None if generated is None else generated.responses
        cfg = self.cfg
        temperature = self.sampling.logprob_temperature
        scorers = {}  # in role order: a rank holding colocated roles scores them in the same order as its peers
        if self.actor is not None:
            scorers["actor"] = scoring.logprobs_of(self.actor.module, temperature)
            if self.ref_from_actor:  # the same module, its adapter off
                scorers["ref"] = scoring.logprobs_of(self.actor.module, temperature, adapter_off=True)
        if self.critic is not None:
            scorers["critic"] = scoring.values_of(self.critic.module)
        if self.ref is not None:
            scorers["ref"] = scoring.logprobs_of(self.ref.model, temperature)
        for name, frozen in self.reward_models.items():
            scorers[name] = scoring.scores_of(frozen.model, cfg.reward.normalize)
        local = scoring.score_roles(scorers, self._per_sample(step_prompts, "input_ids"), responses,
                                    self.tokenizer.pad_token_id, cfg.train.micro_batch_size, self.run.device,
                                    computed_by={"ref": "actor"} if self.ref_from_actor else None)

        with_rules, rules = bool(self.rule_functions or cfg.reward.http_url), None
        if with_rules:
            rules = scoring.rule_scores(cfg, self.rule_functions, self.tokenizer, self.rule_leader,
                                        self._per_sample(step_prompts, "text"), responses,
                                        self._per_sample(step_prompts, "answer"))
        roles = [r for r in ["actor", "critic", "ref", *self.reward_roles]
                 if self.plan.has(r) or (r == "ref" and self.ref_from_actor)]
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            scored = messages.share_scores(local, roles, rules, with_rules, batch)
        if generated is not None and generated.episodes is not None and "rules" in scored:
            scored["rules"] = scored["rules"] + cfg.env.reward_weight * episodes.field(generated, "env_reward")
        return scored

    # -------------------------------------------------------------------------------------------- eval
    def evaluate(self) -> dict[str, float]:
        """Greedy held-out figures, the rollout engines sharing the prompts (on rank 0; nan elsewhere): exact match
        of the answers, or with an environment the mean reward of greedy episodes (and their tool calls)."""
        if not self.eval_prompts:
            return {"eval_accuracy": float("nan")}
        env = self.cfg.env.enabled
        max_tokens = self.cfg.env.max_episode_tokens if env else self.cfg.eval.max_new_tokens
        per_turn = self.cfg.rollout.max_new_tokens if env else self.cfg.eval.max_new_tokens  # episodes: as in training
        sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=per_turn)
        share = engine_generate(self.rollout, self.eval_prompts, sampling, self.weights.engine_awake, self.play)
        with watchdog.phase("exchange"):
            generated = messages.share_generated(share, "eval", len(self.eval_prompts), 1, max_tokens,
                                                 with_episodes=env)
        if generated is None:  # only rank 0 gets the responses, decodes and logs the figure
            return {"eval_accuracy": float("nan")}
        if env:
            return {"eval_accuracy": float(episodes.field(generated, "env_reward").mean()),
                    "eval_tool_calls_mean": float(episodes.field(generated, "tool_calls").mean())}
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in generated.responses]
        answered = [p for p in self.eval_prompts if p["answer"] is not None]
        correct = sum(exact_match(t, p["answer"]) for t, p in zip(texts, self.eval_prompts) if p["answer"] is not None)
        return {"eval_accuracy": correct / max(1, len(answered))}


def run(cfg: Config, mode: str = "ppo") -> dict[str, float]:
    recipe = RLRecipe(cfg, mode)
    recipe.setup()
    return recipe.train()
