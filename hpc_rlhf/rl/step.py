"""`hpc-rlhf ppo` and `hpc-rlhf grpo`: RL from rewards with every role on its own process group. `RLRecipe.train`
is the step; read it top to bottom. Each phase is one module of this package:

  1. prompts     prompts.py     every rank draws the same prompts for batch b (seeded): nothing is sent
  2. rollout     rollout.py     each rollout engine generates n samples for its contiguous share of the prompts
  3. exchange    messages.py    each engine's leader sends its responses (packed tokens + lengths) and their
                                sampling log-probs to the ranks that consume them (the route table: routes.py)
  4. scoring     scoring.py     actor (old log-probs), critic (values), ref (log-probs) and reward models (scores)
                                each on their contiguous shard; rule/remote rewards on one rank
  5. exchange    scoring.py     each role gathers its shard results to its leader, which sends them on (messages.py)
  6. advantages  experience.py  actor and critic ranks turn scores, KL and values into an `Experience` (one pure
                                function, `algorithms.advantages.assemble_advantages`)
  7. training    training.py    actor (clipped policy loss) and critic (clipped value loss), at the same time, each
                                on its own group with DeepSpeed
  8. sync        sync.py        the actor's leader streams the new weights (a LoRA actor: its adapter alone) to the
                                rollout ranks in buckets
     rounds      dynamic_sampling.py  (rl.dynamic_sampling) 2-5 again until the batch holds prompts with signal
     logging     metrics.py     what rank 0 logs about the step
     eval        evaluation.py  greedy held-out figures
     data        batches.py     what the phases hand each other (Generated, SampleBatch, Experience)
     config      config.py      the keys, and the checks that run before any rank starts

Every rank runs this same loop; `groups.has_role(...)` decides what a rank does in each phase, and every exchange
is a collective or point-to-point message that all its ranks enter in the same order (DESIGN §4). The recipe builds
the job's route table once (`routes.Routes`, from the plan and where the reference comes from) and hands it to the
process groups' creation and to every message.

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
from hpc_rlhf.config import ConfigError, ModelSection, TrainSection
from hpc_rlhf.dist import agree, groups, watchdog
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import (build_causal_lm, load_tokenizer, reward_model_tokenizer_problem,
                                      same_tokenizer_problem)
from hpc_rlhf.models.dropout import disable_dropout
from hpc_rlhf.models.value_model import build_value_model
from hpc_rlhf.rl import episodes, messages, training
from hpc_rlhf.rl.config import (Config, check_plan_against_config, is_correction, longest_response, reference_mode,
                                response_limit, reward_role_names, slow_endpoints)
from hpc_rlhf.rl.dynamic_sampling import fill_from_rounds, round_seed
from hpc_rlhf.rl.evaluation import evaluate
from hpc_rlhf.rl.experience import build_experience
from hpc_rlhf.rl.metrics import pad_share, sample_figures, step_timing
from hpc_rlhf.rl.packed import Layout, role_layouts
from hpc_rlhf.rl.prompts import Prompts, load_prompts
from hpc_rlhf.rl.roles import build_rollout_engine, ranks_per_node, sharded_attention
from hpc_rlhf.rl.rollout import Generation, RolloutPipeline, batch_seed, engine_led_here
from hpc_rlhf.rl.routes import LOGGING_RANK, Routes
from hpc_rlhf.rl.scoring import Scoring
from hpc_rlhf.rl.sync import WeightSync
from hpc_rlhf.runtime import checkpointing
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.best_model import BestModel
from hpc_rlhf.runtime.process_rewards import ProcessRewardSpec, process_reward_spec
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
        if plan.role("actor").leader != LOGGING_RANK:  # the logging rank must hold the step's Experience
            raise RuntimeError(f"rank {LOGGING_RANK} logs the step but the actor's leader is rank "
                               f"{plan.role('actor').leader}\n{plan.format_table()}")
        if run.is_main:
            log.info("placement:\n%s", plan.format_table())
            for line in slow_endpoints(cfg):  # a collective timeout would otherwise be blamed for a slow endpoint
                log.warning("%s", line)
        # LoRA with ref_mode=adapter_disabled: the actor's ranks compute the reference, its leader sends it
        ref_from_actor = reference_mode(cfg) == "adapter_disabled" and cfg.rl.kl_coef > 0
        self.routes = Routes(plan, ref_role="actor" if ref_from_actor else "ref")
        groups.initialize(plan, self.routes.message_groups(), timeout_s=cfg.dist.timeout_s)
        run_setup.ensure_tiny_assets_if_used(cfg.data.train_files, cfg.data.eval_files, cfg.actor.path)
        key, tokens = longest_response(cfg)
        run_setup.check_fits_model(cfg.data.max_prompt_len + tokens, cfg.actor.path,
                                   f"data.max_prompt_len + {key}")  # input validation up front
        self.tokenizer = load_tokenizer(cfg.actor.tokenizer or cfg.actor.path)
        rows = load_prompts(cfg, self.tokenizer, cfg.data.train_files, "data.train_files", cfg.data.max_train_rows)
        self.prompts = Prompts(rows, cfg.rollout.prompts_per_step, cfg.rollout.n_samples, cfg.train.seed)
        self.eval_prompts = (load_prompts(cfg, self.tokenizer, cfg.data.eval_files, "data.eval_files",
                                          cfg.eval.max_rows) if cfg.data.eval_files else [])
        self.samples_per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples
        self.sampling = SamplingParams(n=cfg.rollout.n_samples, temperature=cfg.rollout.temperature,
                                       top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                       max_new_tokens=cfg.rollout.max_new_tokens)
        self.reward_roles = reward_role_names(len(cfg.reward.models))
        _, self.max_response_tokens = response_limit(cfg)

        self.actor = self.critic = ref = rollout = None
        reward_models: dict[str, Any] = {}
        if groups.has_role("actor"):
            actor = build_causal_lm(cfg.actor, where="actor")
            disable_dropout(actor)  # old and new log-probs must come from the same network (models/dropout.py)
            self.actor = TrainEngine(actor, self._engine_train_cfg(cfg.train), group=groups.role_group("actor"),
                                     model_dtype=cfg.actor.dtype, sequence_parallel=sharded_attention(actor, "actor"))
        if groups.has_role("critic"):
            critic = build_value_model(cfg.critic, fold_normalization=cfg.reward.normalize)
            disable_dropout(critic)
            self.critic = TrainEngine(critic, self._engine_train_cfg(cfg.critic_train),
                                      group=groups.role_group("critic"), model_dtype=cfg.critic.dtype,
                                      sequence_parallel=sharded_attention(critic, "critic"))
        # Frozen roles: whole on each rank, or sharded over their role's ranks under train.zero_stage=3.
        if groups.has_role("ref"):
            # built for inference: no adapter (a QLoRA actor's reference keeps the 4-bit base, as the actor's)
            ref_cfg = dataclasses.replace(cfg.actor, path=cfg.ref_path or cfg.actor.path)
            ref = FrozenModel(ref_cfg, cfg.train, run.device, group=groups.role_group("ref"))
            sharded_attention(ref.model, "ref")
        teacher = None
        if groups.has_role("teacher"):
            problem = same_tokenizer_problem(cfg.actor.tokenizer or cfg.actor.path, cfg.distill.teacher,
                                             "actor.tokenizer" if cfg.actor.tokenizer else "actor.path")
            if problem:
                raise ConfigError(problem)
            teacher_cfg = ModelSection(path=cfg.distill.teacher, dtype=cfg.actor.dtype,
                                       attn_implementation=cfg.actor.attn_implementation)
            teacher = FrozenModel(teacher_cfg, cfg.train, run.device, group=groups.role_group("teacher"))
            sharded_attention(teacher.model, "teacher")
        self.layout = Layout.of(cfg.rl, self.tokenizer.pad_token_id)  # padded or packed rows (rl.padding_free)
        # each role's: a sequence-parallel role's rows are shared by its rank's block (placement key <kind>_sp)
        self.layouts = role_layouts(self.layout, ["actor", "critic", "ref", "teacher", *self.reward_roles])
        process_specs = {}  # reward roles that hold a process reward model (runtime/process_rewards.py)
        for index, (name, path) in enumerate(zip(self.reward_roles, cfg.reward.models)):
            spec = self._process_reward_spec(index, path, plan.sequence_parallel(name))
            if spec is not None:
                process_specs[name] = spec
            if groups.has_role(name):
                build = build_causal_lm if spec is not None else build_value_model
                reward_models[name] = FrozenModel(ModelSection(path=path, dtype=cfg.actor.dtype), cfg.train,
                                                  run.device, group=groups.role_group(name), build=build)
                sharded_attention(reward_models[name].model, name)
        self.score = Scoring(cfg, self.routes, self.tokenizer, run.device, self.sampling.logprob_temperature,
                             actor=self.actor, critic=self.critic, ref=ref, teacher=teacher,
                             reward_models=reward_models,
                             rule_functions=[(spec, reward_fns.load_reward_function(spec))
                                             for spec in cfg.reward.functions],
                             ref_from_actor=ref_from_actor, layouts=self.layouts, process_specs=process_specs)
        if groups.has_role("rollout"):
            rollout = build_rollout_engine(cfg, plan, self.tokenizer, run.device, actor=self.actor)
        self.weights = WeightSync(plan, self.actor, rollout, cfg.rollout.backend,
                                  cfg.rollout.weight_sync_bucket_mb, adapter_only=cfg.actor.lora.rank > 0)
        # multi-turn episodes (env.name, env.http_url): played where generation runs (rl/episodes.py)
        play = (episodes.EpisodePlayer(cfg.env, self.tokenizer, cfg.data.apply_chat_template)
                if cfg.env.enabled and engine_led_here() is not None else None)
        self.generate = Generation(rollout, self.weights.engine_awake, play)

        state = checkpointing.resume_if_possible(run, self._my_engines())
        if run.start_step > 0 and not plan.is_hybrid:
            self.weights.sync()  # the engines start from the initial weights: give them the resumed ones
        plan = groups.plan()
        engines = len(plan.role("rollout").engines) if plan.has("rollout") else 0
        self.pipeline = RolloutPipeline(cfg.rl.max_staleness, cfg.train.max_steps, engine_led_here(), engines)
        self.pipeline.restore(run.extra.get("resumed_from"), state)  # batches in flight at the checkpoint
        self.stop = checkpointing.StopSignal()
        self.bad_steps = checkpointing.NonFiniteGuard(cfg.train.max_bad_steps, self.mode)
        run_setup.open_logger(run, cfg.train.max_steps)

    def _process_reward_spec(self, index: int, path: str, sequence_parallel: int) -> ProcessRewardSpec | None:
        """A process reward model's spec when reward.models[index] is one (its config records process_reward);
        None for an outcome reward model. Either scores the policy's token ids, so it shares its tokenizer."""
        key = f"reward.models[{index}]"
        actor_key = "actor.tokenizer" if self.cfg.actor.tokenizer else "actor.path"
        problem = reward_model_tokenizer_problem(self.cfg.actor.tokenizer or self.cfg.actor.path, path, actor_key, key)
        if problem:
            raise ConfigError(problem)
        spec = process_reward_spec(path, self.tokenizer, key)
        if spec is None:
            return None
        if sequence_parallel > 1:
            raise ConfigError(f"{key} '{path}' is a process reward model, which scores whole padded rows: its role "
                              f"cannot be sequence parallel (drop its <role>_sp from the placement)")
        return spec

    def _engine_train_cfg(self, train: TrainSection) -> TrainSection:
        """The engine counts optimizer steps: several per RL step (ppo_epochs x samples / batch_size)."""
        updates = self.cfg.rl.ppo_epochs * (self.samples_per_step // train.batch_size)
        return dataclasses.replace(train, max_steps=train.max_steps * updates,
                                   warmup_steps=train.warmup_steps * updates)

    def _my_engines(self) -> dict:
        return {name: engine for name, engine in (("actor", self.actor), ("critic", self.critic)) if engine}

    def _my_models(self) -> dict[str, checkpointing.ModelToSave]:
        """The trained models this rank takes part in, as checkpoint.save_hf writes them into a checkpoint."""
        lora = {"actor": self.cfg.actor.lora, "critic": self.cfg.critic.lora}
        return {name: checkpointing.ModelToSave(engine, self.tokenizer, lora[name])
                for name, engine in self._my_engines().items()}

    # -------------------------------------------------------------------------------------------- the step
    def train(self) -> dict[str, float]:
        cfg, run = self.cfg, self.run
        result = {}
        best = BestModel(run)  # checkpoint.best_metric: the actor of the best evaluation in output_dir/best/
        if run.start_step == 0 and cfg.log.eval_every_steps > 0:
            with watchdog.phase("eval"):  # failure handling: each phase of the loop is named for the watchdog
                result.update(self.evaluate())
            run.logger.log(0, dict(result))
            best.update(0, result, None)  # step 0 is not this run's model: only the figure's name is checked
        elif run_setup.eval_owed_first(run):  # the evaluation a stop signal skipped, of the actor it checkpointed
            with watchdog.phase("eval"):
                result.update(self.evaluate())
            run.logger.log(run.start_step, dict(result))
            best.update(run.start_step, result, self._my_models().get("actor"))
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
            # 4-5. scoring, and the results to the trained roles
            scored = self._score(self.prompts.of(step), batch, generated)
            episode_figures = (episodes.episode_figures(generated)
                               if cfg.env.enabled and dist.get_rank() == LOGGING_RANK else {})
            # 2-5 again (rl.dynamic_sampling): further rounds until the batch holds only prompts that carry signal
            keep_samples, round_figures = None, {}
            if cfg.rl.dynamic_sampling:
                batch, generated, rollout_logps, scored, keep_samples, round_figures = fill_from_rounds(
                    cfg, self.reward_roles, self._trains(), LOGGING_RANK, self.tokenizer.pad_token_id,
                    (self.prompts.per_sample(self.prompts.of(step), "input_ids"), generated, batch, rollout_logps,
                     scored), lambda round_index: self._another_round(step, round_index))
            t_score = time.perf_counter()
            with watchdog.phase("training"):
                # 6. advantages, on the actor's and critic's ranks
                exp, assembly_figures = (build_experience(cfg, batch, scored, rollout_logps, self.reward_roles,
                                                          self.tokenizer.eos_token_id, keep_samples,
                                                          episodes.truncated(generated))
                                         if self._trains() else (None, {}))
                # 7. training, actor and critic at the same time on their own ranks
                metrics, critic_figures = training.train(self.actor, self.critic, cfg, step, exp, run.device,
                                                         self.sampling.logprob_temperature, self.layouts)
            t_train = time.perf_counter()
            # 8. weight sync
            with watchdog.phase("weight_sync"):
                sync_mb = self.weights.sync()
            t_sync = time.perf_counter()
            done = step + 1

            # logging, evaluation, checkpoint. A non-finite step of either trained role counts (each role's ranks
            # skipped it together); a stop signal on any rank stops every rank after this step: both agreed in one
            # all-reduce.
            metrics.update(messages.critic_figures_to_logger(self.routes, critic_figures))
            skipped = bool(metrics.get("actor_skipped", 0.0)) or bool(critic_figures.get("critic_skipped", 0.0))
            skipped, stopping = agree.any_rank([skipped, self.stop.received is not None])
            self.bad_steps.update(skipped, done)
            if dist.get_rank() == LOGGING_RANK:  # the actor's leader (checked in setup): it holds `exp`
                mode, params = is_correction(cfg.rl)
                metrics.update(sample_figures(exp, cfg.rl.kl_estimator, "ref" in scored,
                                              params["cap"] if mode == "tis_token" else None, "actor" in scored))
                metrics.update(assembly_figures)
                metrics["pad_share"] = pad_share(exp.batch, cfg.train.micro_batch_size, self.layout,
                                                 cfg.rl.micro_batch_tokens)
                metrics.update(round_figures)
                metrics.update(episode_figures)
                metrics.update(step_timing(t0, t_generate, t_score, t_train, t_sync, len(generated)))
                metrics.update({"weight_sync_mb": sync_mb, "skipped_steps": self.bad_steps.total,
                                "staleness": staleness})
            # A stop signal's seconds go to the checkpoint: its step's evaluation waits for the resumed run.
            eval_now = bool(cfg.log.eval_every_steps) and (done % cfg.log.eval_every_steps == 0
                                                           or done == cfg.train.max_steps)
            if eval_now and not stopping:
                with watchdog.phase("eval"):
                    result.update(self.evaluate())
                metrics.update(result)
                best.update(done, result, self._my_models().get("actor"))
            if done % cfg.log.every_steps == 0 or "eval_accuracy" in metrics:
                run.logger.log(done, metrics)
            run.logger.advance()
            checkpointing.checkpoint_or_stop(run, done, self._my_engines(), stopping, cfg.train.max_steps,
                                             save_extra=self.pipeline.save,  # the batches in flight go with it
                                             hf_models=self._my_models(), eval_skipped=eval_now)
        with watchdog.phase("checkpoint"):
            if self.actor is not None:
                checkpointing.save_final_model(self.actor, run.output_dir / "final", self.tokenizer, cfg.actor.lora)
            if self.critic is not None:
                checkpointing.save_final_model(self.critic, run.output_dir / "final_critic", self.tokenizer,
                                               cfg.critic.lora)
        dist.barrier()
        run.logger.close()
        return result

    # ------------------------------------------------------------------------------------------ the phases
    def _trains(self) -> bool:
        return self.actor is not None or self.critic is not None

    def _rollout(self, index: int, version: int, phase: str = "rollout") -> None:
        """1-2. The engines generate batch `index` with the weights they hold (policy `version`), seeded by the
        batch; each engine's first rank keeps its share until the batch's exchange. Every rank calls it (the others
        only note the version)."""
        sampling = dataclasses.replace(self.sampling, seed=batch_seed(self.cfg.train.seed, index))
        self.pipeline.put(index, version, self.generate(self.prompts.of(index), sampling, phase))

    def _exchange(self, index: int):
        """3. Batch `index` leaves the pipeline and travels: (padded batch, what the engines generated, sampling
        log-probs (B, T-1)) where they are consumed, else Nones; and the batch's staleness in policy versions."""
        share, staleness = self.pipeline.take(index)
        return (*self._share(share, self.prompts.of(index)), staleness)

    def _share(self, share, prompts: list[dict]):
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            return messages.share_batch(self.routes, share, self.prompts.per_sample(prompts, "input_ids"),
                                        self.cfg.rollout.n_samples, self.max_response_tokens,
                                        self.tokenizer.pad_token_id, with_episodes=self.cfg.env.enabled)

    def _score(self, prompts: list[dict], batch, generated) -> dict:
        """4-5. The batch of `prompts` scored by every role, on the trained roles' ranks (scoring.Scoring)."""
        with watchdog.phase("scoring"):
            return self.score(batch, *(self.prompts.per_sample(prompts, key) for key in ("input_ids", "text", "answer")),
                              generated)

    def _another_round(self, step: int, round_index: int) -> tuple:
        """Dynamic sampling's round `round_index` of batch `step`, generated with the weights the engines hold,
        exchanged and scored like the first: (prompt ids per sample, generated, batch, sampling log-probs, scores)."""
        prompts = self.prompts.of(step, round_index)
        sampling = dataclasses.replace(self.sampling, seed=round_seed(self.cfg.train.seed, step, round_index))
        batch, generated, rollout_logps = self._share(self.generate(prompts, sampling), prompts)
        scored = self._score(prompts, batch, generated)
        return self.prompts.per_sample(prompts, "input_ids"), generated, batch, rollout_logps, scored

    def evaluate(self) -> dict[str, float]:
        """Greedy held-out figures on rank 0 (nan elsewhere): rl/evaluation.py."""
        return evaluate(self.cfg, self.routes, self.generate, self.eval_prompts, self.tokenizer)


def run(cfg: Config, mode: str = "ppo") -> dict[str, float]:
    recipe = RLRecipe(cfg, mode)
    recipe.setup()
    return recipe.train()
