"""The configuration of the RL modes (`hpc-rlhf ppo`, `hpc-rlhf grpo`): sections, defaults and the checks that
run before any rank starts (batch sizes against the placement, roles the config needs, option combinations).
It imports no torch: `--help` and `--dry-run` read it on a login node or in a Slurm batch step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpc_rlhf.algorithms.choices import (DEFAULT_IS_CAP, ESTIMATORS, GSPO_CLIP_EPS, GSPO_CLIP_EPS_HIGH,
                                         GSPO_LOSS_AGGREGATIONS, IS_CORRECTIONS, POLICY_LOSSES, STEP_AGGREGATIONS,
                                         resolve_is_correction)
from hpc_rlhf.config import (TINY_ASSETS, CheckpointSection, ConfigError, DataSection, DistSection, LogSection,
                             ModelSection, TrainSection, field, section)
from hpc_rlhf.dist.memory import VLLM_MAX_LORA_RANKS
from hpc_rlhf.dist.placement import PlacementError, make_plan, role_kind, world_size_of
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.loading import episode_bound_s
from hpc_rlhf.rewards import longest_remote_call_s
from hpc_rlhf.utils.http_post import header_mapping_problem, shown_url, url_problem

ADVANTAGES = ESTIMATORS
REF_MODES = ("auto", "adapter_disabled", "model")
# The group estimators, under which a prompt whose samples all got the same reward has advantage 0: what dynamic
# sampling filters for (algorithms/dynamic_sampling.py).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
# Where the old log-probs come from (rl.old_logprobs): the actor's own scoring pass, the engines' sampling log-probs,
# or the first training forward (no pass of its own).
OLD_LOGPROB_SOURCES = ("recompute", "rollout", "first_forward")
# PPO's clip range, the default of the ppo policy loss (GSPO's is far narrower: algorithms/losses.py) and CISPO's
# upper bound: MiniMax-M1 bounds CISPO's importance weight from above only (a lower clip_eps of 1 leaves r > 0).
PPO_CLIP_EPS = 0.2
CISPO_CLIP_EPS_LOW = 1.0
# Each policy loss's paper weighs answers its own way when rl.loss_agg is unset: GSPO's objective is a mean over
# answers (every answer weighs the same, whatever its length); PPO (as DAPO runs it) and CISPO a mean over tokens.
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
DEFAULT_LOSS_AGG = {"ppo": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean"}


@dataclass
class RolloutSection:
    """Generation: backend, samples per prompt, sampling settings."""
    backend: str = field("hf", choices=["hf", "vllm"],
                         help="hf = a transformers model in the rank's process; vllm = vLLM (its CPU build on CPU, "
                              "its CUDA build on GPUs)")
    prompts_per_step: int = field(16, min=1, help="prompts drawn per RL step")
    n_samples: int = field(4, min=1, help="responses sampled per prompt")
    temperature: float = field(1.0, min=0)
    top_p: float = field(1.0, min=0, max=1)
    top_k: int = field(0, min=0)
    max_new_tokens: int = field(8, min=1)
    max_batch_prompts: int = field(64, min=1, help="hf: prompts per generate call (bounds KV-cache memory)")
    hf_decode_loop: str = field("lean", choices=("lean", "generate"),
                                help="hf: lean (one prefill per prompt for its n samples) or generate (transformers' "
                                     "generate; for a model whose forward the lean loop cannot drive)")
    weight_sync_bucket_mb: int = field(256, min=1, help="bucket size of the actor-to-engine weight broadcast")
    gpu_memory_utilization: float = field(0.5, min=0.05, max=1,
                                          help="vllm on GPU: share of GPU memory it may take (weights + KV cache)")
    kv_cache_mb: int = field(0, min=0, help="vllm: KV-cache size per engine in MiB (0: from gpu_memory_utilization on "
                                            "GPU, 256 on CPU, where vLLM would otherwise reserve a share of the "
                                            "machine's memory)")
    enforce_eager: bool | None = field(None, help="vllm: no CUDA graphs or torch.compile (None: eager on CPU, where "
                                                  "compiling doubled the start-up, graphs on GPU)")


@dataclass
class DistillSection:
    """On-policy distillation: a frozen teacher (the placement's `teacher` role) scores every token the actor
    samples, and each token's advantage gains distill.coef x (log pi_teacher - log pi_old), the negative of the
    per-token reverse KL to the teacher, beside any reward's advantage (docs/recipes.md)."""
    teacher: str | None = field(None, help="teacher model folder, a causal LM with the actor's tokenizer (None = "
                                           "no distillation)")
    coef: float = field(1.0, min=0, help="weight of the per-token reverse-KL advantage (0: the teacher scores, the "
                                         "advantage ignores it)")


@dataclass
class RewardSection:
    """Reward models (one `reward`, `reward2`, ... role each), rule functions and an HTTP endpoint, summed."""
    models: list[str] = field(["runs/rm/final"], help="reward model folders, in role order reward, reward2, ...")
    model_weights: list[float] = field([], help="weight of each reward model (default 1 each)")
    normalize: bool = field(True, help="(score - mean) / std with the held-out statistics stored with a reward "
                                       "model (a no-op for models without them); raw scores get exploited")
    functions: list[str] = field([], help="rule rewards: file.py:function, module:function or exact_match")
    function_weights: list[float] = field([], help="weight of each rule function (default 1 each)")
    http_url: str | None = field(None, help="remote reward endpoint (JSON POST); http:// or https://, no "
                                            "credentials in it (user:password@, ?token=...: use "
                                            "reward.http_headers_from_env)")
    http_weight: float = field(1.0)
    http_timeout_s: float = field(60.0, min=1, help="seconds one try of the remote reward call may take (a "
                                                    "wall-clock deadline; 3 tries in all)")
    http_max_reply_mb: float = field(16.0, help="the largest answer body of the reward endpoint, in MiB")
    http_headers_from_env: dict[str, str] = field({}, help="headers sent to the reward endpoint, as header name -> "
                                                           "the environment variable holding its value; values "
                                                           "never reach logs or config.yaml")
    clip: float = field(0.0, min=0, help="clip the combined score to [-clip, clip] (0 = off)")
    process_aggregate: str = field("min", choices=list(STEP_AGGREGATIONS),
                                   help="a process reward model's (hpc-rlhf prm) reward of a response from its "
                                        "steps' scores; a response without a step marker gets 0")


@dataclass
class RLSection:
    """Advantages, KL and the PPO losses."""
    advantage: str = field("gae", choices=ADVANTAGES, help="gae needs a critic; the others are critic-free")
    gamma: float = field(1.0, min=0, max=1)
    lam: float = field(0.95, min=0, max=1)
    kl_coef: float = field(0.02, min=0, help="KL penalty coefficient (0 = no reference model needed)")
    kl_estimator: str = field("k1", choices=["k1", "k2", "k3"],
                              help="k1 in the reward; in the loss k2 (gradient of KL(pi||ref)) or k3 (of KL(ref||pi))")
    kl_in_reward: bool = field(True, help="KL as a per-token reward penalty (true) or a loss term (false)")
    policy_loss: str = field("ppo", choices=POLICY_LOSSES,
                             help="ppo: clipped token ratio; gspo: clipped sequence ratio (geometric mean of token "
                                  "ratios); cispo: clipped, detached importance weight on every token's log-prob")
    clip_eps: float | None = field(None, min=0, help=f"ratio clip, > 0 (None = {PPO_CLIP_EPS} for ppo, "
                                                      f"{GSPO_CLIP_EPS} for gspo, {CISPO_CLIP_EPS_LOW:g} for cispo: "
                                                      "no lower bound, as MiniMax-M1)")
    clip_eps_high: float | None = field(None, min=0, help=f"asymmetric upper clip (DAPO's clip-higher), > 0 (None = "
                                                           f"clip_eps; {GSPO_CLIP_EPS_HIGH} for gspo; {PPO_CLIP_EPS} "
                                                           "for cispo when clip_eps is unset too)")
    dual_clip: float | None = field(None, min=1, help="dual-clip constant c > 1 (None = off; ppo only)")
    value_clip_eps: float | None = field(0.2, min=0, help="critic value clip, > 0 (None = unclipped value loss)")
    is_correction: str = field("auto", choices=("auto",) + IS_CORRECTIONS,
                               help="importance sampling between the engine that sampled (pi_rollout) and the "
                                    "trainer (pi_old): tis_token/tis_seq weight tokens by the truncated token or "
                                    "sequence ratio, mis_token/mis_seq drop tokens or responses whose ratio leaves "
                                    f"[is_low, is_high]; auto = tis_token with cap {DEFAULT_IS_CAP} when "
                                    "rl.max_staleness >= 1 or rl.tis_cap is set (tis_seq for gspo), else none")
    tis_cap: float | None = field(None, min=0, help="truncation cap of tis_token/tis_seq, > 0 (None = "
                                                     f"{DEFAULT_IS_CAP}); setting it with is_correction=auto turns "
                                                     "token TIS on")
    is_low: float | None = field(None, min=0, help="mis_token/mis_seq: lowest kept ratio, < 1 (None = 1 / is_high)")
    is_high: float | None = field(None, min=0, help=f"mis_token/mis_seq: highest kept ratio, > 1 (None = "
                                                     f"{DEFAULT_IS_CAP})")
    max_staleness: int = field(0, min=0, help="asynchronous RL: the rollout engines generate K batches ahead "
                                              "while the actor trains, so a batch is trained on by weights up to K "
                                              "RL steps newer than those that generated it (0 = synchronous; "
                                              "K >= 1 needs a disjoint placement)")
    ppo_epochs: int = field(1, min=1, help="passes over each step's experience")
    old_logprobs: str = field("recompute", choices=list(OLD_LOGPROB_SOURCES),
                              help="where the policy loss's old log-probs come from: recompute = the actor scores "
                                   "the samples before training (a forward pass of its own); rollout = the engines' "
                                   "sampling log-probs (the loss's ratio is then pi / pi_rollout, which corrects for "
                                   "the engine itself); first_forward = the first training forward's, detached (one "
                                   "optimizer step per batch, rl.ppo_epochs=1, and nothing before training that "
                                   "reads them)")
    padding_free: bool = field(True, help="every role scores and trains on packed rows of real tokens (position ids "
                                          "restarting per sample, attention kept within a sample) instead of "
                                          "right-padded ones; the same numbers within float rounding "
                                          "(docs/recipes.md); false = right-padded rows")
    padding_free_row_tokens: int = field(0, min=0, help="rl.padding_free: tokens per packed row at most (0 = the "
                                                        "longest sample of the micro-batch: each row costs attention "
                                                        "no more than a padded row)")
    micro_batch_tokens: int = field(0, min=0, help="training's micro-batches of at most this many tokens (prompt + "
                                                   "response; a longer sample alone) instead of "
                                                   "train.micro_batch_size / critic_train.micro_batch_size samples: "
                                                   "even work per micro-batch when lengths are long-tailed (0 = by "
                                                   "samples)")
    score_micro_batch_tokens: int = field(0, min=0, help="scoring's micro-batches (forwards without gradients) of at "
                                                         "most this many tokens (0 = rl.micro_batch_tokens; both 0: "
                                                         "train.micro_batch_size samples)")
    entropy_coef: float = field(0.0, min=0)
    loss_agg: str = field("auto", choices=["auto", *LOSS_AGGREGATIONS],
                          help="how token losses add up to the step's loss (auto = the policy loss's paper: "
                               "seq-mean-token-mean for gspo, token-mean for ppo and cispo)")
    whiten_advantages: bool = field(True, help="GAE/REINFORCE: whiten advantages over the batch")
    normalize_rewards: bool = field(False, help="normalise scores over the batch before advantages")
    dynamic_sampling: bool = field(False, help="DAPO: drop prompts whose samples all got the same reward and fill "
                                               "the batch from further generation rounds (group estimators only)")
    dynamic_sampling_max_rounds: int = field(3, min=1, help="dynamic sampling: generation rounds per step at most "
                                                            "(the first included); short of a full batch after them, "
                                                            "the step trains on what there is")
    overlong_buffer: int = field(0, min=0, help="DAPO's soft overlong penalty over the last N tokens before "
                                                "rollout.max_new_tokens (0 = off)")
    overlong_penalty: float = field(1.0, min=0, help="the overlong penalty at the length limit (it falls linearly "
                                                     "from 0 to -this over rl.overlong_buffer tokens)")
    overlong_filter: bool = field(False, help="DAPO: responses cut by the length limit (no end-of-sequence token) "
                                              "are left out of the policy loss")


@dataclass
class RLEvalSection:
    """Held-out exact match by greedy generation on data.eval_files (every log.eval_every_steps)."""
    max_rows: int = field(200, min=1)
    max_new_tokens: int = field(8, min=1, help="tokens of a greedy answer (episodes: rollout.max_new_tokens per turn)")


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
    ref_path: str | None = field(None, help="reference model folder of ref_mode=model (default: actor.path)")
    ref_mode: str = field("auto", choices=REF_MODES,
                          help="the KL reference: model = a frozen model on the 'ref' role's ranks (ref_path); "
                               "adapter_disabled = the LoRA actor with its adapter off, on the actor's ranks (no "
                               "'ref' role, no second copy); auto = adapter_disabled for a LoRA actor "
                               "(actor.lora.rank > 0) unless ref_path names another folder, else model")
    reward: RewardSection = section(RewardSection)
    distill: DistillSection = section(DistillSection)
    rollout: RolloutSection = section(RolloutSection)
    rl: RLSection = section(RLSection)
    data: DataSection = dataclasses.field(default_factory=_rl_data)
    train: TrainSection = dataclasses.field(default_factory=_actor_train)
    critic_train: TrainSection = dataclasses.field(default_factory=_critic_train)
    eval: RLEvalSection = section(RLEvalSection)
    env: EnvSection = section(EnvSection)
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
        for name, train in (("train", self.train), ("critic_train", self.critic_train)):
            if train.group_by_length:
                raise ConfigError(f"{name}.group_by_length sorts a one-model mode's rows; an RL step's micro-batches "
                                  "are cut from its samples: rl.padding_free packs them into rows of real tokens")
        if self.rl.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") and self.rollout.n_samples < 2:
            raise ConfigError(f"rl.advantage={self.rl.advantage} compares samples of one prompt: "
                              f"rollout.n_samples must be at least 2")
        if self.model_weights_given_wrong():
            raise ConfigError(f"reward.model_weights has {len(self.reward.model_weights)} entries for "
                              f"{len(self.reward.models)} reward.models")
        if self.reward.function_weights and len(self.reward.function_weights) != len(self.reward.functions):
            raise ConfigError(f"reward.function_weights has {len(self.reward.function_weights)} entries for "
                              f"{len(self.reward.functions)} reward.functions")
        self.env.validate()
        self._check_reward_endpoint()
        if not (self.reward.models or self.reward.functions or self.reward.http_url or self.env.enabled
                or self.distill.teacher):
            raise ConfigError("no reward: set reward.models, reward.functions, reward.http_url, an environment "
                              "(env.name, env.http_url), or a teacher to distill from (distill.teacher)")
        self._check_rl_options()
        self._check_lora()
        self._check_placement()

    def _check_reward_endpoint(self) -> None:
        reward = self.reward
        problem = None if reward.http_url is None else url_problem(reward.http_url, "reward.http_headers_from_env")
        if problem is not None:
            raise ConfigError(f"reward.http_url {problem}")
        if reward.http_max_reply_mb <= 0:
            raise ConfigError(f"reward.http_max_reply_mb must be > 0, got {reward.http_max_reply_mb}")
        problem = header_mapping_problem(reward.http_headers_from_env, "reward.http_headers_from_env")
        if problem is not None:
            raise ConfigError(problem)

    def _check_rl_options(self) -> None:
        """Bounds stricter than a field's inclusive min, and combinations that would train something else than
        what they say (each refused naming both keys)."""
        rl = self.rl
        for key, value, bound in (("clip_eps", rl.clip_eps, 0), ("clip_eps_high", rl.clip_eps_high, 0),
                                  ("value_clip_eps", rl.value_clip_eps, 0), ("dual_clip", rl.dual_clip, 1),
                                  ("tis_cap", rl.tis_cap, 0)):
            if value is not None and value <= bound:
                off = "" if key in ("clip_eps", "tis_cap") else " (or leave it unset to turn it off)"
                raise ConfigError(f"rl.{key} must be > {bound}, got {value}{off}")
        try:
            mode, _ = is_correction(rl)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if rl.policy_loss == "gspo":
            if mode in ("tis_token", "mis_token"):
                raise ConfigError(f"rl.policy_loss=gspo weighs whole responses by their sequence ratio, but "
                                  f"rl.is_correction={rl.is_correction} corrects token by token: use tis_seq or "
                                  "mis_seq (or auto)")
            if loss_aggregation(rl) not in GSPO_LOSS_AGGREGATIONS:
                raise ConfigError(f"rl.policy_loss=gspo takes rl.loss_agg {' or '.join(GSPO_LOSS_AGGREGATIONS)}, not "
                                  f"{rl.loss_agg} (its loss is already length-normalised per response)")
        if rl.dual_clip is not None and rl.policy_loss != "ppo":
            raise ConfigError(f"rl.dual_clip bounds PPO's token loss; rl.policy_loss={rl.policy_loss} has none: "
                              "unset rl.dual_clip")
        self._check_old_logprobs(mode)
        if rl.dynamic_sampling and rl.advantage not in GROUP_ESTIMATORS:
            raise ConfigError(f"rl.dynamic_sampling drops prompts whose samples share a reward, which carry no signal "
                              f"only for group estimators ({', '.join(GROUP_ESTIMATORS)}), not "
                              f"rl.advantage={rl.advantage}")
        key, limit = response_limit(self)
        if rl.overlong_buffer > limit:
            raise ConfigError(f"rl.overlong_buffer={rl.overlong_buffer} is longer than {key}={limit}")
        longest = self.data.max_prompt_len + limit
        if rl.padding_free and 0 < rl.padding_free_row_tokens < longest:
            raise ConfigError(f"rl.padding_free_row_tokens={rl.padding_free_row_tokens} is shorter than the longest "
                              f"sample (data.max_prompt_len + {key} = {longest}), which must fit one row: raise it, "
                              "or set 0 (rows as long as each micro-batch's longest sample)")
        if rl.kl_coef > 0 and not rl.kl_in_reward and rl.kl_estimator == "k1":
            raise ConfigError("rl.kl_estimator=k1 as a loss term (rl.kl_in_reward=false) has zero expected gradient: "
                              "it adds noise, not a pull towards the reference. Use rl.kl_estimator=k2 (gradient of "
                              "KL(pi||ref)) or k3 (gradient of KL(ref||pi)), or keep k1 in the reward "
                              "(rl.kl_in_reward=true)")

    def _check_old_logprobs(self, correction: str) -> None:
        """rl.old_logprobs other than recompute, where what it leaves out would be needed."""
        rl = self.rl
        if rl.old_logprobs == "recompute":
            return
        if correction != "none":
            raise ConfigError(f"rl.old_logprobs={rl.old_logprobs} leaves no old log-probs of the trainer's own to "
                              f"compare with the engines' before training, which rl.is_correction={rl.is_correction}"
                              f"{' (with rl.tis_cap)' if rl.tis_cap is not None else ''} does: use "
                              "rl.old_logprobs=recompute, or no correction")
        if rl.old_logprobs != "first_forward":
            return
        samples = self.rollout.prompts_per_step * self.rollout.n_samples
        why = None
        if rl.ppo_epochs != 1:
            why = f"rl.ppo_epochs={rl.ppo_epochs} passes over the batch after the weights have moved"
        elif samples != self.train.batch_size:
            why = (f"a step's {samples} samples (rollout.prompts_per_step x rollout.n_samples) are trained in "
                   f"{samples / self.train.batch_size:g} optimizer steps of train.batch_size={self.train.batch_size}: "
                   "the later ones would see moved weights")
        elif rl.kl_coef > 0 and rl.kl_in_reward:
            why = "rl.kl_in_reward=true needs the actor's log-probs in the rewards, before training"
        elif rl.max_staleness > 0:
            why = (f"rl.max_staleness={rl.max_staleness} trains on batches of older weights, which only the "
                   "importance correction (reading the old log-probs before training) accounts for")
        if why is not None:
            raise ConfigError(f"rl.old_logprobs=first_forward takes the old log-probs from the first training forward, "
                              f"but {why}: use rl.old_logprobs=recompute (or rollout)")

    def _check_lora(self) -> None:
        """The reference of a LoRA actor and the adapter the engines take (issue 27: adapter-only sync)."""
        lora = self.actor.lora
        if self.ref_mode == "adapter_disabled":
            if lora.rank <= 0:
                raise ConfigError("ref_mode=adapter_disabled uses the LoRA actor with its adapter off as the "
                                  "reference, but actor.lora.rank is 0 (full fine-tuning): set actor.lora.rank > 0 "
                                  "or ref_mode=model")
            if self.ref_path not in (None, self.actor.path):
                raise ConfigError(f"ref_path='{self.ref_path}' contradicts ref_mode=adapter_disabled, whose reference "
                                  f"is the actor's own base model (actor.path='{self.actor.path}'): drop ref_path, or "
                                  "set ref_mode=model for a separate reference model")
        if self.rollout.backend == "vllm" and lora.rank > VLLM_MAX_LORA_RANKS[-1]:
            raise ConfigError(f"actor.lora.rank={lora.rank} is larger than the vllm rollout engine allows (LoRA rank "
                              f"at most {VLLM_MAX_LORA_RANKS[-1]} in vLLM 0.32): lower actor.lora.rank or use "
                              "rollout.backend=hf")

    def _check_placement(self) -> None:
        """Input validation up front: the roles and per-role batch sizes follow from the placement alone, so a
        mismatch is reported before any rank starts (the node layout is checked again at launch)."""
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


@dataclass
class GRPOConfig(Config):
    """`hpc-rlhf grpo`: the keys of `hpc-rlhf ppo` with the critic-free defaults (rl/grpo.py says which)."""
    output_dir: str = field("runs/grpo")
    placement: str = field("actor=1,ref=1,rollout=2", help="roles on ranks (no critic)")
    reward: RewardSection = dataclasses.field(
        default_factory=lambda: RewardSection(models=[], functions=["exact_match"]))
    rl: RLSection = dataclasses.field(
        default_factory=lambda: RLSection(advantage="grpo", kl_in_reward=False, kl_estimator="k3"))


def is_correction(rl: RLSection) -> tuple[str, dict[str, float]]:
    """The importance-sampling correction of the policy loss: (mode, parameters) of
    `algorithms.importance.off_policy_correction` (ValueError naming the keys for a combination that says nothing).
    `auto` is token TIS where batches may come from older weights or rl.tis_cap is set, and its sequence-level
    form for GSPO, whose ratio is a sequence's."""
    if rl.is_correction == "auto" and rl.old_logprobs != "recompute" and rl.tis_cap is None:
        return "none", {}  # nothing to correct: no old log-probs of the trainer's own before training (see below)
    mode, params = resolve_is_correction(rl.is_correction, rl.tis_cap, rl.max_staleness, rl.is_low, rl.is_high)
    if rl.is_correction == "auto" and rl.policy_loss == "gspo" and mode == "tis_token":
        mode = "tis_seq"
    return mode, params


def clip_range(rl: RLSection) -> tuple[float, float | None]:
    """(clip_eps, clip_eps_high) of the policy loss, with each loss's own defaults where the keys are unset."""
    if rl.clip_eps is not None:
        return rl.clip_eps, rl.clip_eps_high  # clip_eps_high None: symmetric
    if rl.policy_loss == "gspo":
        return GSPO_CLIP_EPS, GSPO_CLIP_EPS_HIGH if rl.clip_eps_high is None else rl.clip_eps_high
    if rl.policy_loss == "cispo":
        return CISPO_CLIP_EPS_LOW, PPO_CLIP_EPS if rl.clip_eps_high is None else rl.clip_eps_high
    return PPO_CLIP_EPS, rl.clip_eps_high


def loss_aggregation(rl: RLSection) -> str:
    """rl.loss_agg, or the policy loss's own default for auto (DEFAULT_LOSS_AGG)."""
    return DEFAULT_LOSS_AGG[rl.policy_loss] if rl.loss_agg == "auto" else rl.loss_agg

def response_limit(cfg: Config, evaluation: bool = False) -> tuple[str, int]:
    """The most tokens a response of this job holds after its prompt, and the key that sets it: an episode's limit
    with an environment (its turns and observations), else a rollout's (`evaluation`: an evaluation's)."""
    if cfg.env.enabled:
        return "env.max_episode_tokens", cfg.env.max_episode_tokens
    if evaluation:
        return "eval.max_new_tokens", cfg.eval.max_new_tokens
    return "rollout.max_new_tokens", cfg.rollout.max_new_tokens


def longest_response(cfg: Config) -> tuple[str, int]:
    """The longest response of this job, training or evaluation (`response_limit`), with its key."""
    return max(response_limit(cfg), response_limit(cfg, evaluation=True), key=lambda limit: limit[1])


def reference_mode(cfg: Config) -> str:
    """`ref_mode` with `auto` resolved: adapter_disabled for a LoRA actor whose reference folder is its own base
    (ref_path unset or actor.path), else model."""
    if cfg.ref_mode != "auto":
        return cfg.ref_mode
    lora_base = cfg.actor.lora.rank > 0 and cfg.ref_path in (None, cfg.actor.path)
    return "adapter_disabled" if lora_base else "model"




def slow_endpoints(cfg: Config) -> list[str]:
    """One line per endpoint whose worst case outlasts dist.timeout_s: an environment episode (reset and
    env.max_turns steps, every try to its deadline, with retries and pauses) or a remote reward call. While a rank
    waits that long on it, its peers wait in a collective and time out first, blaming the collective; these lines
    (logged at start) give the figures and the keys that change them."""
    lines = []
    limit = cfg.dist.timeout_s
    env = cfg.env
    if env.enabled:
        episode = episode_bound_s(env)
        if episode > limit:
            what = f"env.http_url {shown_url(env.http_url)}" if env.http_url else f"env.name {env.name}"
            tries = (f"(env.retries + 1 = {env.retries + 1}) tries of env.timeout_s = {env.timeout_s:g} s with the "
                     f"pauses between them" if env.http_url else f"env.timeout_s = {env.timeout_s:g} s")
            lines.append(f"{what}: one episode may wait {episode:g} s on its environment (reset and env.max_turns = "
                         f"{env.max_turns} steps, each up to {tries}), more than dist.timeout_s = {limit} s, after "
                         f"which the other ranks give up waiting: lower env.timeout_s, env.retries or env.max_turns, "
                         f"or raise dist.timeout_s")
    if cfg.reward.http_url:
        call = longest_remote_call_s(cfg.reward.http_timeout_s)
        if call > limit:
            lines.append(f"reward.http_url {shown_url(cfg.reward.http_url)}: one call may take {call:g} s (3 tries of "
                         f"reward.http_timeout_s = {cfg.reward.http_timeout_s:g} s with the pauses between them), "
                         f"more than dist.timeout_s = {limit} s, after which the other ranks give up waiting: lower "
                         f"reward.http_timeout_s or raise dist.timeout_s")
    return lines


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
    ref_from_actor = reference_mode(cfg) == "adapter_disabled"
    if cfg.rl.kl_coef > 0 and not ref_from_actor:
        needed.append("ref")
    if ref_from_actor and plan.has("ref"):
        mode = "ref_mode=adapter_disabled" if cfg.ref_mode == "adapter_disabled" else \
            "a LoRA actor (ref_mode=auto: adapter_disabled)"
        problems.append(f"with {mode} the reference is the actor with its adapter off, computed on the actor's "
                        "ranks, so the 'ref' role would hold an unused copy: remove it from the placement, or set "
                        "ref_mode=model to keep a separate reference model")
    if cfg.distill.teacher:
        needed.append("teacher")
    elif plan.has("teacher"):
        problems.append("the placement has a 'teacher' role but distill.teacher names no teacher model folder")
    names = reward_role_names(len(cfg.reward.models))
    needed += names
    for name in needed:
        if not plan.has(name):
            problems.append(f"the placement has no '{name}' role, which this config needs")
    extra = [n for n in plan.roles if n.startswith("reward") and n not in names]
    if extra:
        problems.append(f"the placement has {', '.join(extra)} but reward.models lists {len(names)} model(s)")
    if cfg.rl.max_staleness and plan.is_hybrid:
        problems.append(f"rl.max_staleness={cfg.rl.max_staleness} overlaps generation with training on other "
                        "ranks, but with rollout@actor the engines generate on the actor's own ranks, so there is "
                        "nothing to overlap: use rl.max_staleness=0 here, or give the rollout ranks of its own "
                        "(e.g. actor=1,ref=1,rollout=2)")
    if cfg.rollout.backend == "hf" and plan.rollout_tp > 1:
        problems.append("the hf rollout backend does no tensor parallelism: use rollout_tp=1 or rollout.backend=vllm")
    sharded = [f"{role_kind(name)}_sp={plan.sequence_parallel(name)}" for name in plan.roles
               if name != "rollout" and plan.sequence_parallel(name) > 1]
    if sharded and not cfg.rl.padding_free:
        problems.append(f"{', '.join(dict.fromkeys(sharded))}: sequence parallelism splits packed rows: set "
                        "rl.padding_free=true")
    if problems:
        raise ConfigError(f"placement '{cfg.placement}': " + "; ".join(problems) + "\n" + plan.format_table())
