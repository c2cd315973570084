"""`hpc-rlhf ppo` (and `hpc-rlhf grpo`): RL from rewards with every role on its own process group.

Every rank runs this same loop; `groups.has_role(...)` decides what a rank does in each phase, and every
exchange is a collective that all ranks enter in the same order (DESIGN §4):

  1. prompts     every rank draws the same prompts for step s (seeded): nothing is sent
  2. rollout     each rollout engine generates n samples for its contiguous share of the prompts
  3. exchange    each engine's leader broadcasts its responses (packed tokens + lengths) to the world
  4. scoring     actor (old log-probs), critic (values), ref (log-probs), reward models (scores) each work on
                 their contiguous shard; rule/remote rewards on one rank
  5. exchange    each role gathers its shard results to its leader, which broadcasts them to the world
  6. advantages  actor and critic ranks compute rewards, KL and advantages (pure functions, same everywhere)
  7. training    actor (clipped policy loss) and critic (clipped value loss) train at the same time, each
                 on its own group with DeepSpeed
  8. sync        the actor's leader sends the new weights to the rollout ranks in buckets
                 (hybrid `rollout@actor`: the engines generate with the actor's own module, nothing to send)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf.algorithms import advantages as adv
from hpc_rlhf.algorithms.kl import kl_estimate, kl_penalized_rewards
from hpc_rlhf.algorithms.logprobs import entropy_from_logits, masked_mean, masked_whiten
from hpc_rlhf.algorithms.losses import policy_loss, value_loss
from hpc_rlhf.config import (TINY_ASSETS, CheckpointSection, ConfigError, DataSection, DistSection, LogSection,
                             ModelSection, TrainSection, field, section)
from hpc_rlhf.data.examples import prompt_example
from hpc_rlhf.data.loading import load_rows
from hpc_rlhf.dist import exchange, groups, watchdog
from hpc_rlhf.dist.placement import make_plan, world_size_of
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.models.value_model import sequence_scores, token_values
from hpc_rlhf import rewards as reward_fns
from hpc_rlhf.trainers import common
from hpc_rlhf.engines import deepspeed_compat
from hpc_rlhf.trainers.experience import from_ragged, make_batch, response_logprobs, shard_bounds, to_ragged
from hpc_rlhf.trainers.reference import FrozenModel
from hpc_rlhf.utils import faults

log = logging.getLogger("hpc_rlhf")

ADVANTAGES = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


# ================================================================================================== config
@dataclass
class RolloutSection:
    """Generation: backend, samples per prompt, sampling settings."""
    backend: str = field("hf", choices=["hf", "vllm"], help="hf = transformers generate (CPU/GPU); vllm = GPU")
    prompts_per_step: int = field(16, min=1, help="prompts drawn per RL step")
    n_samples: int = field(4, min=1, help="responses sampled per prompt")
    temperature: float = field(1.0, min=0)
    top_p: float = field(1.0, min=0, max=1)
    top_k: int = field(0, min=0)
    max_new_tokens: int = field(8, min=1)
    max_batch_prompts: int = field(64, min=1, help="prompts per generate call (bounds KV-cache memory)")
    weight_sync_bucket_mb: int = field(256, min=1, help="bucket size of the actor-to-engine weight broadcast")
    gpu_memory_utilization: float = field(0.5, min=0.05, max=1, help="vllm: share of GPU memory it may take")
    enforce_eager: bool = field(False, help="vllm: no CUDA graphs")


@dataclass
class RewardSection:
    """Reward models (one `reward`, `reward2`, ... role each), rule functions and an HTTP endpoint, summed."""
    models: list[str] = field(["runs/rm/final"], help="reward model folders, in role order reward, reward2, ...")
    model_weights: list[float] = field([], help="weight of each reward model (default 1 each)")
    normalize: bool = field(True, help="(score - mean) / std with the held-out statistics stored with a reward "
                                       "model (a no-op for models without them); raw scores get exploited")
    functions: list[str] = field([], help="rule rewards: file.py:function, module:function or exact_match")
    function_weights: list[float] = field([], help="weight of each rule function (default 1 each)")
    http_url: str | None = field(None, help="remote reward endpoint (JSON POST)")
    http_weight: float = field(1.0)
    http_timeout_s: float = field(60.0, min=1)
    clip: float = field(0.0, min=0, help="clip the combined score to [-clip, clip] (0 = off)")


@dataclass
class RLSection:
    """Advantages, KL and the PPO losses."""
    advantage: str = field("gae", choices=ADVANTAGES, help="gae needs a critic; the others are critic-free")
    gamma: float = field(1.0, min=0, max=1)
    lam: float = field(0.95, min=0, max=1)
    kl_coef: float = field(0.02, min=0, help="KL penalty coefficient (0 = no reference model needed)")
    kl_estimator: str = field("k1", choices=["k1", "k2", "k3"])
    kl_in_reward: bool = field(True, help="KL as a per-token reward penalty (true) or a loss term (false)")
    clip_eps: float = field(0.2, min=0)
    clip_eps_high: float | None = field(None, min=0, help="asymmetric upper clip (None = clip_eps)")
    dual_clip: float | None = field(None, min=1, help="dual-clip constant c > 1 (None = off)")
    value_clip_eps: float = field(0.2, min=0)
    ppo_epochs: int = field(1, min=1, help="passes over each step's experience")
    entropy_coef: float = field(0.0, min=0)
    loss_agg: str = field("token-mean", choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
    whiten_advantages: bool = field(True, help="GAE/REINFORCE: whiten advantages over the batch")
    normalize_rewards: bool = field(False, help="normalise scores over the batch before advantages")


@dataclass
class RLEvalSection:
    """Held-out exact match by greedy generation on data.eval_files (every log.eval_every_steps)."""
    max_rows: int = field(200, min=1)
    max_new_tokens: int = field(8, min=1)


def _rl_data() -> DataSection:
    return DataSection(train_files=[f"{TINY_ASSETS}/data/prompts_train.jsonl"],
                       eval_files=[f"{TINY_ASSETS}/data/prompts_eval.jsonl"], max_prompt_len=16, max_len=32)


def _actor_train() -> TrainSection:
    return TrainSection(lr=5e-5, warmup_steps=0, max_steps=100, micro_batch_size=32, batch_size=64,
                        min_lr_ratio=1.0)


def _critic_train() -> TrainSection:
    return TrainSection(lr=1e-4, warmup_steps=0, max_steps=100, micro_batch_size=32, batch_size=64,
                        min_lr_ratio=1.0)


@dataclass
class Config:
    output_dir: str = field("runs/ppo")
    placement: str = field("actor=1,critic=1,ref=1,reward=1,rollout=2",
                           help="roles on ranks, e.g. actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2")
    ranks_per_node: int = field(0, min=0, help="ranks per node (0 = from the launcher)")
    actor: ModelSection = dataclasses.field(default_factory=lambda: ModelSection(path="runs/sft/final"))
    critic: ModelSection = dataclasses.field(default_factory=lambda: ModelSection(path="runs/rm/final"))
    ref_path: str | None = field(None, help="reference model folder (default: actor.path)")
    reward: RewardSection = section(RewardSection)
    rollout: RolloutSection = section(RolloutSection)
    rl: RLSection = section(RLSection)
    data: DataSection = dataclasses.field(default_factory=_rl_data)
    train: TrainSection = dataclasses.field(default_factory=_actor_train)
    critic_train: TrainSection = dataclasses.field(default_factory=_critic_train)
    eval: RLEvalSection = section(RLEvalSection)
    log: LogSection = dataclasses.field(default_factory=lambda: LogSection(every_steps=1, eval_every_steps=20))
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)

    def world_size(self) -> int:
        return world_size_of(self.placement)

    def validate(self) -> None:
        samples = self.rollout.prompts_per_step * self.rollout.n_samples
        trained = [("train", self.train)] + ([("critic_train", self.critic_train)] if self.rl.advantage == "gae"
                                             else [])  # critic-free modes never read critic_train
        for name, train in trained:
            if samples % train.batch_size:
                raise ConfigError(f"{name}.batch_size={train.batch_size} must divide the samples of a step "
                                  f"(rollout.prompts_per_step x rollout.n_samples = {samples})")
        if self.rl.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") and self.rollout.n_samples < 2:
            raise ConfigError(f"rl.advantage={self.rl.advantage} compares samples of one prompt: "
                              f"rollout.n_samples must be at least 2")
        if self.model_weights_given_wrong():
            raise ConfigError(f"reward.model_weights has {len(self.reward.model_weights)} entries for "
                              f"{len(self.reward.models)} reward.models")
        if self.reward.function_weights and len(self.reward.function_weights) != len(self.reward.functions):
            raise ConfigError(f"reward.function_weights has {len(self.reward.function_weights)} entries for "
                              f"{len(self.reward.functions)} reward.functions")
        if not (self.reward.models or self.reward.functions or self.reward.http_url):
            raise ConfigError("no reward: set reward.models, reward.functions or reward.http_url")
        self._check_placement()

    def _check_placement(self) -> None:
        """Input validation up front: the roles and per-role batch sizes follow from the placement alone, so a
        mismatch is reported before any rank starts (the node layout is checked again at launch)."""
        from hpc_rlhf.dist.placement import PlacementError

        try:
            world = world_size_of(self.placement)
            plan = make_plan(self.placement, world, self.ranks_per_node or world)
        except PlacementError as exc:
            raise ConfigError(f"placement '{self.placement}': {exc}") from None
        check_plan_against_config(plan, self)
        for role, name, train in (("actor", "train", self.train), ("critic", "critic_train", self.critic_train)):
            if plan.has(role):
                size = len(plan.role(role).ranks)
                per_pass = train.micro_batch_size * size
                if train.batch_size % per_pass:
                    raise ConfigError(f"{name}.batch_size={train.batch_size} must be a multiple of "
                                      f"{name}.micro_batch_size ({train.micro_batch_size}) x ranks of the role "
                                      f"'{role}' ({size}) = {per_pass}")

    def model_weights_given_wrong(self) -> bool:
        return bool(self.reward.model_weights) and len(self.reward.model_weights) != len(self.reward.models)


def reward_role_names(count: int) -> list[str]:
    return ["reward" if i == 0 else f"reward{i + 1}" for i in range(count)]


def check_plan_against_config(plan, cfg: Config) -> None:
    """The roles the placement holds must be the ones the config needs, before any model is loaded."""
    needed = ["actor", "rollout"]
    problems = []
    if cfg.rl.advantage == "gae":
        needed.append("critic")
    elif plan.has("critic"):
        problems.append(f"rl.advantage={cfg.rl.advantage} uses no critic, but the placement has one")
    if cfg.rl.kl_coef > 0:
        needed.append("ref")
    names = reward_role_names(len(cfg.reward.models))
    needed += names
    for name in needed:
        if not plan.has(name):
            problems.append(f"the placement has no '{name}' role, which this config needs")
    extra = [n for n in plan.roles if n.startswith("reward") and n not in names]
    if extra:
        problems.append(f"the placement has {', '.join(extra)} but reward.models lists {len(names)} model(s)")
    if cfg.rollout.backend == "hf" and plan.rollout_tp > 1:
        problems.append("the hf rollout backend does no tensor parallelism: use rollout_tp=1 or rollout.backend=vllm")
    if problems:
        raise ConfigError(f"placement '{cfg.placement}': " + "; ".join(problems) + "\n" + plan.format_table())


# ================================================================================================== recipe
class RLRecipe:
    def __init__(self, cfg: Config, mode: str = "ppo"):
        self.cfg = cfg
        self.mode = mode

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = common.start_run(cfg, self.mode)
        ranks_per_node = cfg.ranks_per_node or _ranks_per_node(run.world_size)
        self.plan = plan = make_plan(cfg.placement, run.world_size, ranks_per_node)
        check_plan_against_config(plan, cfg)
        if run.is_main:
            log.info("placement:\n%s", plan.format_table())
        groups.initialize(plan, timeout_s=cfg.dist.timeout_s)
        common.ensure_tiny_assets_if_used(cfg.data.train_files, cfg.data.eval_files, cfg.actor.path)
        common.check_fits_model(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, cfg.actor.path,
                                "data.max_prompt_len + rollout.max_new_tokens")  # input validation up front
        self.tokenizer = load_tokenizer(cfg.actor.tokenizer or cfg.actor.path)
        self.prompts = self._load_prompts(cfg.data.train_files, "data.train_files", cfg.data.max_train_rows)
        self.eval_prompts = (self._load_prompts(cfg.data.eval_files, "data.eval_files", cfg.eval.max_rows)
                             if cfg.data.eval_files else [])
        self.samples_per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples
        self.reward_roles = reward_role_names(len(cfg.reward.models))

        self.actor = self.critic = self.ref = self.rollout = None
        self._last_critic: dict[str, float] = {}
        self.reward_models: dict[str, Any] = {}
        if groups.has_role("actor"):
            self.actor = TrainEngine(build_causal_lm(cfg.actor), self._engine_train_cfg(cfg.train),
                                     group=groups.role_group("actor"), model_dtype=cfg.actor.dtype)
        if groups.has_role("critic"):
            from hpc_rlhf.models.value_model import build_value_model

            self.critic = TrainEngine(build_value_model(cfg.critic), self._engine_train_cfg(cfg.critic_train),
                                      group=groups.role_group("critic"), model_dtype=cfg.critic.dtype)
        # Frozen roles: whole on each rank, or sharded over their role's ranks under train.zero_stage=3.
        if groups.has_role("ref"):
            ref_cfg = dataclasses.replace(cfg.actor, path=cfg.ref_path or cfg.actor.path,
                                          lora=dataclasses.replace(cfg.actor.lora, rank=0))
            self.ref = FrozenModel(ref_cfg, cfg.train, run.device, group=groups.role_group("ref"))
        for name, path in zip(self.reward_roles, cfg.reward.models):
            if groups.has_role(name):
                from hpc_rlhf.models.value_model import build_value_model

                self.reward_models[name] = FrozenModel(ModelSection(path=path, dtype=cfg.actor.dtype), cfg.train,
                                                       run.device, group=groups.role_group(name),
                                                       build=build_value_model)
        self.rule_functions = [(spec, reward_fns.load_reward_function(spec)) for spec in cfg.reward.functions]
        if groups.has_role("rollout"):
            self.rollout = self._build_rollout_engine()

        engines = self._my_engines()
        common.resume_if_possible(run, engines)
        if run.start_step > 0 and not plan.is_hybrid:
            self._sync_weights()  # the engines start from the initial weights: give them the resumed ones
        self.stop = common.StopSignal()
        self.bad_steps = common.NonFiniteGuard(cfg.train.max_bad_steps, self.mode)
        common.open_logger(run, cfg.train.max_steps)

    def _engine_train_cfg(self, train: TrainSection) -> TrainSection:
        """The engine counts optimizer steps: several per RL step (ppo_epochs x samples / batch_size)."""
        updates = self.cfg.rl.ppo_epochs * (self.samples_per_step // train.batch_size)
        return dataclasses.replace(train, max_steps=train.max_steps * updates, warmup_steps=train.warmup_steps * updates)

    def _load_prompts(self, paths, where: str, max_rows) -> list[dict]:
        data = self.cfg.data
        rows, _ = load_rows(paths, required={data.prompt_key: str}, where=where, on_bad_row=data.on_bad_row,
                            max_rows=max_rows)
        out = []
        for row in rows:
            ids = prompt_example(self.tokenizer, prompt=row[data.prompt_key], max_prompt_len=data.max_prompt_len,
                                 chat_template=data.apply_chat_template, where=row["_source"])["input_ids"]
            answer = row.get(data.answer_key)
            out.append({"input_ids": ids, "text": row[data.prompt_key],
                        "answer": None if answer is None else str(answer)})
        return out

    def _build_rollout_engine(self):
        cfg = self.cfg
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        if cfg.rollout.backend == "vllm":
            return self._build_vllm_engine(eos)
        from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

        if self.plan.is_hybrid:  # generate with the actor's own (gathered, under ZeRO-3) parameters
            return HFRolloutEngine(self.actor.module, pad, eos, max_batch_prompts=cfg.rollout.max_batch_prompts,
                                   full_params=self.actor.gathered_parameters)
        model = build_causal_lm(dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora, rank=0)),
                                for_training=False, device=self.run.device)
        return HFRolloutEngine(model, pad, eos, max_batch_prompts=cfg.rollout.max_batch_prompts)

    def _build_vllm_engine(self, eos: int):
        """One vLLM engine per rollout engine, driven by the engine's first rank (DESIGN §9): vLLM runs in
        processes of its own on the engine's GPUs; the other ranks of the engine leave their GPUs to it."""
        from hpc_rlhf.engines.rollout.vllm import VLLMRolloutEngine

        cfg = self.cfg
        engine_ranks = self.plan.role("rollout").engines[groups.rollout_engine_of_rank()]
        if dist.get_rank() != engine_ranks[0]:
            return None
        per_node = self.plan.ranks_per_node
        return VLLMRolloutEngine(cfg.actor.path, eos, tensor_parallel_size=len(engine_ranks),
                                 gpu_ids=[r % per_node for r in engine_ranks],
                                 gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                                 enforce_eager=cfg.rollout.enforce_eager, seed=cfg.train.seed,
                                 enable_sleep_mode=self.plan.is_hybrid,
                                 max_model_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
                                 bucket_mb=cfg.rollout.weight_sync_bucket_mb)

    def _my_engines(self) -> dict:
        engines = {}
        if self.actor is not None:
            engines["actor"] = self.actor
        if self.critic is not None:
            engines["critic"] = self.critic
        return engines

    # ------------------------------------------------------------------------------------------ phase 2-3
    def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[torch.Tensor]:
        """Every engine generates for its share; every rank returns all responses, prompt-major."""
        engines = self.plan.role("rollout").engines
        mine = None
        if groups.has_role("rollout"):
            e = groups.rollout_engine_of_rank()
            start, end = shard_bounds(len(prompts), len(engines), e)
            if dist.get_rank() == engines[e][0]:
                mine = []
                if end > start:
                    seeded = dataclasses.replace(sampling, seed=None if sampling.greedy else
                                                 (sampling.seed or 0) * 7919 + e)
                    with self._engine_awake():
                        out = self.rollout.generate(prompts[start:end], seeded)
                    mine = [r for per_prompt in out.responses for r in per_prompt]
        responses = []
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            for e, engine_ranks in enumerate(engines):
                sent = mine if dist.get_rank() == engine_ranks[0] else None
                responses += exchange.broadcast_ragged(sent, src=engine_ranks[0], group=None, tag="responses",
                                                       dtype=torch.long)
        return responses

    @contextlib.contextmanager
    def _engine_awake(self):
        """A hybrid vLLM engine sleeps while the actor trains: load the actor's weights, wake, generate, sleep."""
        if not (self.plan.is_hybrid and self.cfg.rollout.backend == "vllm"):
            yield
            return
        from hpc_rlhf.dist import weight_sync

        with self.actor.gathered_parameters() as module:
            if self.cfg.actor.lora.rank > 0:
                from hpc_rlhf.models.lora import merged_state_dict

                state = merged_state_dict(module)
            else:
                state = dict(module.state_dict())
            weight_sync.load_local_weights(_hf_names(state), self.rollout.load_weights,
                                           bucket_mb=self.cfg.rollout.weight_sync_bucket_mb)
        self.rollout.wake()
        try:
            yield
        finally:
            self.rollout.sleep()

    # ------------------------------------------------------------------------------------------ phase 4-5
    def _score_on_shard(self, role: str, batch_fn, compute) -> list[torch.Tensor] | None:
        """Run `compute` on this rank's shard of the role, gather to the role leader; leader gets all."""
        if not groups.has_role(role):
            return None
        size, index = len(groups.role_ranks(role)), groups.rank_in_role(role)
        start, end = shard_bounds(self.samples_per_step, size, index)
        self._largest_shard = math.ceil(self.samples_per_step / size)
        self._dummy_batch = batch_fn(0, 1)
        results = compute(batch_fn(start, end) if end > start else self._dummy_batch.__class__(
            *[t[:0] for t in (self._dummy_batch.input_ids, self._dummy_batch.attention_mask,
                              self._dummy_batch.action_mask)], [], []))
        gathered = exchange.gather_ragged(results, dst=groups.role_leader(role), group=groups.role_group(role),
                                          tag=f"{role}-scores", dtype=torch.float32)
        return exchange.flatten_ranks(gathered) if gathered is not None else None

    def _share(self, role: str, full: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Role leader -> every rank (all ranks call this for every scoring role, in the same order)."""
        leader = groups.role_leader(role)
        return exchange.broadcast_ragged(full if dist.get_rank() == leader else None, src=leader, group=None,
                                         tag=f"{role}-shared", dtype=torch.float32)

    def _micro(self, fn, batch, micro: int):
        """`fn` over micro-batches; every rank of a role runs as many passes as the one with the largest shard
        (a ZeRO-3 model gathers parameters collectively in each), the extra ones on a dummy row, dropped."""
        count = batch.input_ids.shape[0]
        passes = math.ceil(self._largest_shard / micro)
        outs = []
        for p in range(passes):
            start = p * micro
            if start < count:
                outs += fn(_slice_batch(batch, start, start + micro))
            else:
                fn(_slice_batch(self._dummy_batch, 0, 1))
        return outs

    @torch.no_grad()
    def _score(self, sample_prompts, responses, texts, answers) -> dict[str, list[torch.Tensor]]:
        cfg, device = self.cfg, self.run.device
        pad = self.tokenizer.pad_token_id
        micro = cfg.train.micro_batch_size

        def batch_fn(start, end):
            return make_batch(sample_prompts[start:end], responses[start:end], pad).to(device)

        def logps_of(model):
            def compute(batch):
                def one(sub):
                    logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask, use_cache=False).logits
                    return to_ragged(response_logprobs(logits.float(), sub), sub)
                return self._micro(one, batch, micro)
            return compute

        def values_of(model):
            def compute(batch):
                def one(sub):
                    values = token_values(model, sub.input_ids, sub.attention_mask)[:, :-1]
                    return to_ragged(values.float(), sub)
                return self._micro(one, batch, micro)
            return compute

        def scores_of(model):
            def compute(batch):
                def one(sub):
                    s = sequence_scores(model, sub.input_ids, sub.attention_mask, normalize=cfg.reward.normalize)
                    return [v.reshape(1).float().cpu() for v in s]
                return self._micro(one, batch, micro)
            return compute

        local: dict[str, list | None] = {}
        if self.actor is not None:
            with self.actor.gathered_parameters() as module:
                was = module.training
                module.eval()
                local["actor"] = self._score_on_shard("actor", batch_fn, logps_of(module))
                module.train(was)
        if self.critic is not None:
            with self.critic.gathered_parameters() as module:
                was = module.training
                module.eval()
                local["critic"] = self._score_on_shard("critic", batch_fn, values_of(module))
                module.train(was)
        if self.ref is not None:
            with deepspeed_compat.keep_collectives_in_group(self.ref.group):
                local["ref"] = self._score_on_shard("ref", batch_fn, logps_of(self.ref.model))
        for name in self.reward_roles:
            if name in self.reward_models:
                frozen = self.reward_models[name]
                with deepspeed_compat.keep_collectives_in_group(frozen.group):
                    local[name] = self._score_on_shard(name, batch_fn, scores_of(frozen.model))

        shared = {}
        with watchdog.phase("exchange"):  # failure handling: phase for heartbeats and fault injection
            for role in ["actor", "critic", "ref", *self.reward_roles]:
                if self.plan.has(role):
                    shared[role] = self._share(role, local.get(role))
        shared["rules"] = self._rule_scores(texts, answers)
        return shared

    def _rule_scores(self, texts: list[str], answers: list[str | None]) -> list[torch.Tensor]:
        """Rule functions and the HTTP endpoint run once, on the first scoring role's leader."""
        cfg = self.cfg
        scorer = self.reward_roles[0] if self.reward_roles else "actor"
        leader = groups.role_leader(scorer)
        full = None
        if dist.get_rank() == leader:
            total = torch.zeros(len(texts))
            prompts_text = [p for p in self.step_prompt_texts]
            weights = cfg.reward.function_weights or [1.0] * len(self.rule_functions)
            for (spec, fn), w in zip(self.rule_functions, weights):
                total += w * torch.tensor(reward_fns.call_reward_function(fn, spec, prompts_text, texts, answers))
            if cfg.reward.http_url:
                total += cfg.reward.http_weight * torch.tensor(reward_fns.remote_rewards(
                    cfg.reward.http_url, prompts_text, texts, answers, timeout_s=cfg.reward.http_timeout_s))
            full = [v.reshape(1) for v in total]
        return exchange.broadcast_ragged(full, src=leader, group=None, tag="rule-scores", dtype=torch.float32)

    def _combined_scores(self, shared) -> torch.Tensor:
        model_scores = [torch.stack([v[0] for v in shared[name]]) for name in self.reward_roles]
        return combine_scores(torch.stack([v[0] for v in shared["rules"]]), model_scores,
                              self.cfg.reward.model_weights or [1.0] * len(model_scores))

    # -------------------------------------------------------------------------------------------- phase 6
    def _advantages(self, batch, shared) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        rl = cfg.rl
        mask = batch.action_mask
        n = cfg.rollout.n_samples
        scores = self._combined_scores(shared)
        raw_scores = scores.clone()
        if rl.normalize_rewards:
            scores = adv.normalize_rewards(scores)
        if cfg.reward.clip > 0:
            scores = adv.clip_rewards(scores, cfg.reward.clip)
        old_logps = from_ragged(shared["actor"], batch)
        ref_logps = from_ragged(shared["ref"], batch) if "ref" in shared else old_logps.clone()
        kl = kl_estimate(old_logps, ref_logps, kind=rl.kl_estimator) * mask
        out = {"old_logps": old_logps, "ref_logps": ref_logps, "scores": raw_scores, "kl": kl}
        penalty = rl.kl_coef if rl.kl_in_reward else 0.0
        if rl.advantage == "gae":
            values = from_ragged(shared["critic"], batch)
            token_rewards = kl_penalized_rewards(scores, kl, mask, penalty)
            advantages, returns = adv.gae(token_rewards, values, mask, rl.gamma, rl.lam)
            if rl.whiten_advantages:
                advantages = masked_whiten(advantages, mask)
            out.update(values=values, returns=returns)
        elif rl.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
            if rl.advantage == "reinforce_pp_baseline":
                scores = scores - scores.view(-1, n).mean(dim=1, keepdim=True).reshape(-1)
            token_rewards = kl_penalized_rewards(scores, kl, mask, penalty)
            advantages = adv.reinforce_pp_advantages(token_rewards, mask, gamma=rl.gamma)
        else:
            seq_adv = {"grpo": adv.grpo_advantages, "dr_grpo": adv.dr_grpo_advantages,
                       "rloo": adv.rloo_advantages}[rl.advantage](scores, n)
            if penalty:  # a per-sequence KL penalty keeps the group baseline meaningful
                seq_adv = seq_adv - penalty * (kl.sum(dim=1))
            advantages = adv.broadcast_to_tokens(seq_adv.reshape(-1), mask)
        out["advantages"] = advantages * mask
        return out

    # -------------------------------------------------------------------------------------------- phase 7
    def _train_actor(self, step: int, batch, exp) -> dict[str, float]:
        cfg, rl = self.cfg, self.cfg.rl
        size, index = len(groups.role_ranks("actor")), groups.rank_in_role("actor")
        stats = {"policy_loss": [], "clip_fraction": [], "approx_kl": [], "entropy": [], "kl_loss": []}
        infos = []
        for epoch in range(rl.ppo_epochs):
            order = torch.randperm(self.samples_per_step,
                                   generator=torch.Generator().manual_seed(cfg.train.seed * 31 + step * 7 + epoch))
            for start in range(0, self.samples_per_step, cfg.train.batch_size):
                chosen = order[start:start + cfg.train.batch_size].tolist()
                lo, hi = shard_bounds(len(chosen), size, index)
                mine = chosen[lo:hi]
                for m in range(0, len(mine), cfg.train.micro_batch_size):
                    idx = torch.tensor(mine[m:m + cfg.train.micro_batch_size])
                    sub = _select(batch, idx).to(self.run.device)
                    mask = sub.action_mask
                    logits = self.actor(input_ids=sub.input_ids, attention_mask=sub.attention_mask,
                                        use_cache=False).logits.float()
                    logps = response_logprobs(logits, sub)
                    loss, clip_frac, approx_kl = policy_loss(
                        logps, _rows(exp["old_logps"], idx, sub), _rows(exp["advantages"], idx, sub),
                        mask, clip_eps=rl.clip_eps, clip_eps_high=rl.clip_eps_high, dual_clip=rl.dual_clip,
                        loss_agg=rl.loss_agg)
                    if rl.kl_coef > 0 and not rl.kl_in_reward:
                        kl = kl_estimate(logps, _rows(exp["ref_logps"], idx, sub), kind=rl.kl_estimator)
                        kl_loss = masked_mean(kl, mask)
                        loss = loss + rl.kl_coef * kl_loss
                        stats["kl_loss"].append(kl_loss.item())
                    with torch.no_grad():
                        entropy = masked_mean(entropy_from_logits(logits[:, :-1]), mask)
                    if rl.entropy_coef > 0:
                        loss = loss - rl.entropy_coef * masked_mean(entropy_from_logits(logits[:, :-1]), mask)
                    loss = faults.poison(loss, step + 1)  # failure handling: HPC_RLHF_FAULT kind=nan
                    self.actor.backward(loss)
                    infos.append(self.actor.step())
                    stats["policy_loss"].append(loss.item())
                    stats["clip_fraction"].append(float(clip_frac))
                    stats["approx_kl"].append(float(approx_kl))
                    stats["entropy"].append(entropy.item())
        group = groups.role_group("actor")
        out = {k: common.reduce_mean(common.mean_over(v), group) for k, v in stats.items() if v}
        stepped = [i for i in infos if i.stepped]
        out["actor_grad_norm"] = stepped[-1].grad_norm if stepped else float("nan")
        out["actor_lr"] = stepped[-1].lr if stepped else self.actor.lr
        out["actor_skipped"] = float(any(i.skipped for i in stepped))
        return out

    def _train_critic(self, step: int, batch, exp) -> dict[str, float]:
        cfg, rl = self.cfg, self.cfg.rl
        train = cfg.critic_train
        size, index = len(groups.role_ranks("critic")), groups.rank_in_role("critic")
        losses, clips, infos = [], [], []
        for epoch in range(rl.ppo_epochs):
            order = torch.randperm(self.samples_per_step,
                                   generator=torch.Generator().manual_seed(train.seed * 37 + step * 11 + epoch))
            for start in range(0, self.samples_per_step, train.batch_size):
                chosen = order[start:start + train.batch_size].tolist()
                lo, hi = shard_bounds(len(chosen), size, index)
                mine = chosen[lo:hi]
                for m in range(0, len(mine), train.micro_batch_size):
                    idx = torch.tensor(mine[m:m + train.micro_batch_size])
                    sub = _select(batch, idx).to(self.run.device)
                    values = token_values(self.critic.module, sub.input_ids, sub.attention_mask)[:, :-1].float()
                    loss, clip_frac = value_loss(values, _rows(exp["values"], idx, sub),
                                                 _rows(exp["returns"], idx, sub), sub.action_mask,
                                                 clip_eps=rl.value_clip_eps)
                    loss = faults.poison(loss, step + 1)  # failure handling: HPC_RLHF_FAULT kind=nan
                    self.critic.backward(loss)
                    infos.append(self.critic.step())
                    losses.append(loss.item())
                    clips.append(float(clip_frac))
        group = groups.role_group("critic")
        stepped = [i for i in infos if i.stepped]
        return {"value_loss": common.reduce_mean(common.mean_over(losses), group),
                "value_clip_fraction": common.reduce_mean(common.mean_over(clips), group),
                "critic_grad_norm": stepped[-1].grad_norm if stepped else float("nan"),
                "critic_skipped": float(any(i.skipped for i in stepped))}

    # -------------------------------------------------------------------------------------------- phase 8
    def _sync_weights(self) -> float:
        """Actor leader -> every rollout rank, in buckets. Returns megabytes sent (at the leader)."""
        from hpc_rlhf.dist import weight_sync

        if self.plan.is_hybrid:
            return 0.0
        sent = 0.0
        src = groups.role_leader("actor")
        if self.actor is not None:
            state = self._actor_state_for_sync()  # collective over the actor group; full on the leader only
            if dist.get_rank() == src:
                stats = weight_sync.send_weights(_hf_names(state), src=src, group=groups.weight_sync_group(),
                                                 bucket_mb=self.cfg.rollout.weight_sync_bucket_mb)
                sent = stats.bytes / 2**20
        if groups.has_role("rollout"):
            # A vLLM engine's other ranks are in the group but hold no engine: they take part and drop the data.
            load = self.rollout.load_weights if self.rollout is not None else (lambda named: None)
            weight_sync.receive_weights(src=src, group=groups.weight_sync_group(), load_fn=load)
        return float(sent)

    def _actor_state_for_sync(self) -> dict[str, torch.Tensor]:
        if self.cfg.actor.lora.rank == 0:
            return self.actor.full_state_dict()
        from hpc_rlhf.models.lora import merged_state_dict

        with self.actor.gathered_parameters() as module:  # adapters folded into the base weights
            return merged_state_dict(module) if self.actor.is_leader else {}

    # -------------------------------------------------------------------------------------------- eval
    def evaluate(self) -> float:
        """Greedy held-out exact match, the rollout engines sharing the prompts."""
        if not self.eval_prompts:
            return float("nan")
        prompts = [p["input_ids"] for p in self.eval_prompts]
        sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.cfg.eval.max_new_tokens)
        responses = self._generate(prompts, sampling)
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in responses]
        from hpc_rlhf.data.synthetic import exact_match

        correct = sum(exact_match(t, p["answer"]) for t, p in zip(texts, self.eval_prompts) if p["answer"] is not None)
        return correct / max(1, sum(p["answer"] is not None for p in self.eval_prompts))

    # -------------------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, float]:
        cfg, run = self.cfg, self.run
        n = cfg.rollout.n_samples
        sampling = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens)
        result = {}
        if run.start_step == 0 and cfg.log.eval_every_steps > 0:
            with watchdog.phase("eval"):  # failure handling: each phase of the loop is named for the watchdog
                result["eval_accuracy"] = self.evaluate()
            run.logger.log(0, {"eval_accuracy": result["eval_accuracy"]})
        for step in range(run.start_step, cfg.train.max_steps):
            watchdog.set_step(step + 1)
            t0 = time.perf_counter()
            chosen = common.step_indices(len(self.prompts), cfg.rollout.prompts_per_step, step, cfg.train.seed)
            step_prompts = [self.prompts[i] for i in chosen]
            sample_prompts = [p["input_ids"] for p in step_prompts for _ in range(n)]
            self.step_prompt_texts = [p["text"] for p in step_prompts for _ in range(n)]
            answers = [p["answer"] for p in step_prompts for _ in range(n)]

            with watchdog.phase("rollout"):
                responses = self._generate([p["input_ids"] for p in step_prompts],
                                           dataclasses.replace(sampling, seed=cfg.train.seed * 100003 + step))
            t_generate = time.perf_counter()
            texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in responses]
            batch = make_batch(sample_prompts, responses, self.tokenizer.pad_token_id)
            with watchdog.phase("scoring"):
                shared = self._score(sample_prompts, responses, texts, answers)
            t_score = time.perf_counter()

            metrics: dict[str, float] = {}
            with watchdog.phase("training"):
                if self.actor is not None or self.critic is not None:
                    exp = self._advantages(batch, shared)
                    if self.actor is not None:
                        metrics.update(self._train_actor(step, batch, exp))
                    if self.critic is not None:
                        self._last_critic = self._train_critic(step, batch, exp)
            t_train = time.perf_counter()
            metrics.update(self._critic_metrics_to_actor())
            with watchdog.phase("weight_sync"):
                sync_mb = self._sync_weights()
            t_sync = time.perf_counter()
            done = step + 1

            # A non-finite step of either trained role counts (each role's ranks skipped it together).
            skipped = bool(metrics.get("actor_skipped", 0.0)) or bool(self._last_critic.get("critic_skipped", 0.0))
            self.bad_steps.update(_any_rank(skipped), done)
            if run.is_main:
                mask = batch.action_mask
                scores = self._combined_scores(shared)
                kl = (kl_estimate(from_ragged(shared["actor"], batch), from_ragged(shared["ref"], batch), kind="k1")
                      * mask).sum(1) if "ref" in shared else torch.zeros(1)
                elapsed = t_sync - t0
                metrics.update({
                    "reward": scores.mean().item(), "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
                    "kl": kl.mean().item(), "response_length": float(sum(batch.response_lens)) / len(responses),
                    "time_generate": t_generate - t0, "time_score": t_score - t_generate,
                    "time_train": t_train - t_score, "time_sync": t_sync - t_train, "time_step": elapsed,
                    "samples_per_s": len(responses) / max(elapsed, 1e-9), "weight_sync_mb": sync_mb,
                    "skipped_steps": self.bad_steps.total,
                })
            if cfg.log.eval_every_steps and (done % cfg.log.eval_every_steps == 0 or done == cfg.train.max_steps):
                with watchdog.phase("eval"):
                    metrics["eval_accuracy"] = result["eval_accuracy"] = self.evaluate()
            if done % cfg.log.every_steps == 0 or "eval_accuracy" in metrics:
                run.logger.log(done, metrics)
            run.logger.advance()
            common.checkpoint_or_stop(run, done, self._my_engines(), self.stop, cfg.train.max_steps)
        with watchdog.phase("checkpoint"):
            if self.actor is not None:
                common.save_final_model(self.actor, run.output_dir / "final", self.tokenizer, cfg.actor.lora)
            if self.critic is not None:
                common.save_final_model(self.critic, run.output_dir / "final_critic", self.tokenizer,
                                        cfg.critic.lora)
        dist.barrier()
        run.logger.close()
        return result

    def _critic_metrics_to_actor(self) -> dict[str, float]:
        """The critic's figures, from its leader to every rank (rank 0 logs them)."""
        if not self.plan.has("critic"):
            return {}
        keys = ("value_loss", "value_clip_fraction", "critic_grad_norm")
        leader = groups.role_leader("critic")
        values = torch.zeros(len(keys), dtype=torch.float64)
        if dist.get_rank() == leader:
            values = torch.tensor([self._last_critic.get(k, float("nan")) for k in keys], dtype=torch.float64)
        dist.broadcast(values, src=leader)
        return dict(zip(keys, values.tolist()))


def combine_scores(rule_scores: torch.Tensor, model_scores: list[torch.Tensor],
                   model_weights: list[float]) -> torch.Tensor:
    """One score per sample: the (already weighted) rule/remote rewards plus each reward model's weighted score."""
    total = rule_scores.float().clone()
    for scores, weight in zip(model_scores, model_weights, strict=True):
        total += weight * scores.float()
    return total


def _ranks_per_node(world_size: int) -> int:
    from hpc_rlhf.dist.bootstrap import current_launch

    info = current_launch()  # after init: under MPI the node layout is known only then
    return (info.ranks_per_node if info is not None else None) or world_size


def _hf_names(state: dict[str, torch.Tensor]):
    from hpc_rlhf.engines.rollout.base import hf_param_name

    for name, tensor in state.items():
        hf_name = hf_param_name(name)
        if hf_name is not None:  # None: a LoRA adapter tensor, already merged into its base weight
            yield hf_name, tensor


def _select(batch, idx: torch.Tensor):
    from hpc_rlhf.trainers.experience import SampleBatch

    prompt_lens = [batch.prompt_lens[i] for i in idx.tolist()]
    response_lens = [batch.response_lens[i] for i in idx.tolist()]
    width = max(p + r for p, r in zip(prompt_lens, response_lens))
    width = max(width, 2)
    return SampleBatch(batch.input_ids[idx, :width], batch.attention_mask[idx, :width],
                       batch.action_mask[idx, :width - 1], prompt_lens, response_lens)


def _rows(t: torch.Tensor, idx: torch.Tensor, sub) -> torch.Tensor:
    """Rows `idx` of a (B, T-1) experience tensor, cut to the micro-batch's width and moved to its device."""
    return t[idx, :sub.action_mask.shape[1]].to(sub.action_mask.device)


def _slice_batch(batch, start: int, end: int):
    return _select(batch, torch.arange(start, min(end, batch.input_ids.shape[0])))


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def run(cfg: Config, mode: str = "ppo") -> dict[str, float]:
    recipe = RLRecipe(cfg, mode)
    recipe.setup()
    return recipe.train()
