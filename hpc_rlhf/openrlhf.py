"""`hpc-rlhf from-openrlhf [--mode ppo|dpo|rm|prm|sft|kd] [--set KEY=VALUE ...] -- <OpenRLHF flags>`: an hpc_rlhf YAML
config from the command-line flags of OpenRLHF's training scripts (train_ppo_ray, train_dpo, train_rm, train_prm,
train_sft, train_kd).

Every flag the converter knows is in one table, `FLAGS`, and is one of three kinds:
- mapped: set to the hpc_rlhf key(s) of the same meaning (a note says where the two differ in a detail);
- ignored: accepted and listed in the output, because it changes nothing that hpc_rlhf computes (the reason says
  why that is so: a launcher's variable, a speed setting of vLLM, ...);
- refused: there is no exact equivalent; the converter stops with one line naming the flag and why (exit code 2).
  Some refusals are lifted by giving the hpc_rlhf key instead with `--set` (e.g. --num_episodes by
  `--set train.max_steps=N`: hpc_rlhf counts steps, OpenRLHF passes over the data).
A flag that is not in the table is refused by name. The output is checked against the mode's Config (the keys,
their types and ranges, the placement against the batch sizes) before it is printed.

The names are those of OpenRLHF's flat command line (up to 0.10.1, e.g. --actor_num_gpus_per_node, including the
older --bf16, --flash_attn, --prompt_max_len, --generate_max_len) and, as aliases, the dotted names of 0.10.2 and
later (--actor.num_gpus_per_node, --ds.zero_stage, ...). Only the flags given are translated: a key that no
given flag sets keeps hpc_rlhf's default (`hpc-rlhf MODE --help`), which is not always OpenRLHF's; the output ends
with the list of those keys, for the flags of the table that were not given. The placement is the exception: its
counts come from the role flags, with OpenRLHF's default of 1 node x 8 GPUs for a role whose flags are missing.

`flag_table(mode)` renders the table as markdown (the documentation's mapping page is generated from it).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from hpc_rlhf.config import ConfigError, all_keys, from_dict, parse_override
from hpc_rlhf.launch.modes import mode_config

PROG = "hpc-rlhf from-openrlhf"
MODES = ("ppo", "dpo", "rm", "prm", "sft", "kd")
SCRIPTS = {"ppo": "train_ppo_ray", "dpo": "train_dpo", "rm": "train_rm", "prm": "train_prm", "sft": "train_sft",
           "kd": "train_kd"}
ALL = MODES
ONE_MODEL = ("dpo", "rm", "prm", "sft", "kd")
ROLE_DEFAULT_NODES, ROLE_DEFAULT_GPUS = 1, 8  # OpenRLHF's default for every role's --*_num_nodes/--*_num_gpus_per_node
ADVANTAGES = {"gae": "gae", "reinforce": "reinforce_pp", "rloo": "rloo", "reinforce_baseline": "reinforce_pp_baseline",
              "group_norm": "grpo", "dr_grpo": "dr_grpo"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
ATTENTION = ("flash_attention_2", "sdpa", "eager")
OPENRLHF_TRAIN_MAX_TOKENS = 16192  # train_ppo_ray's default --train_max_tokens_per_gpu


class ConversionError(ValueError):
    """A flag that cannot be converted exactly, or a value it cannot take; the message names the flag."""


# ================================================================================================= the table
@dataclass(frozen=True)
class Flag:
    """One OpenRLHF flag: its names (the flat one first), the scripts that take it, what it takes (`switch`,
    `value`, `pair`: two values, `list`: values up to the next flag), how its value is read (`cast`), and its kind:
    `apply` sets hpc_rlhf keys (`keys` shows them, {model}/{train} standing for the mode's model and training
    sections), `ignored` says why it changes nothing here, `refused` why there is no equivalent. `noop`: values
    that ask for what hpc_rlhf does anyway ("off", or its only choice): accepted as ignored, others refused.
    `lifted_by`: a refused flag is accepted when that hpc_rlhf key is given with --set. `core`: see the field."""
    names: tuple[str, ...]
    modes: tuple[str, ...]
    takes: str = "value"
    cast: Callable[[str], Any] = str
    keys: str = ""
    apply: Callable[["Conversion", Any], None] | None = None
    ignored: str = ""
    refused: str = ""
    noop: tuple = ()
    lifted_by: str = ""
    note: str = ""
    core: bool = False  # it sets what a run computes: when not given, the output lists the hpc_rlhf default it keeps

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def kind(self) -> str:
        return "mapped" if self.apply is not None else ("ignored" if self.ignored else "refused")


def _sections(mode: str, template: str) -> list[str]:
    """`template` with {model} and {train} filled in for `mode`: PPO trains an actor and a critic."""
    models = ("actor", "critic") if mode == "ppo" else ("model",)
    trains = ("train", "critic_train") if mode == "ppo" else ("train",)
    if "{model}" in template:
        return [template.format(model=m) for m in models]
    if "{train}" in template:
        return [template.format(train=t) for t in trains]
    return [template]


def to(template: str, transform: Callable[[Any], Any] | None = None) -> Callable[["Conversion", Any], None]:
    """Set every key of `template` (see _sections) to the flag's value, transformed."""
    def apply(conv: "Conversion", value: Any) -> None:
        for key in _sections(conv.mode, template):
            conv.set(key, transform(value) if transform else value)
    return apply


def both(*appliers: Callable[["Conversion", Any], None]) -> Callable[["Conversion", Any], None]:
    def apply(conv: "Conversion", value: Any) -> None:
        for one in appliers:
            one(conv, value)
    return apply


def keep(slot: str) -> Callable[["Conversion", Any], None]:
    """Keep the value for the placement and lengths, worked out once every flag is read (Conversion.finish)."""
    def apply(conv: "Conversion", value: Any) -> None:
        conv.kept[slot] = value
    return apply


def _choice(options: dict[str, Any], flag: str) -> Callable[[Any], Any]:
    def transform(value: Any) -> Any:
        if value not in options:
            raise ConversionError(f"{flag} {value}: the converter takes {', '.join(options)}")
        return options[value]
    return transform


def _paths(value: str) -> list[str]:
    return [p.strip() for p in str(value).split(",") if p.strip()]


def _one_path(flag: str) -> Callable[[Any], Any]:
    def transform(value: Any) -> Any:
        paths = _paths(value)
        if len(paths) != 1:
            raise ConversionError(f"{flag} {value}: several reward models share one group of GPUs in OpenRLHF; in "
                                  f"hpc_rlhf each is a role of its own (reward, reward2, ...): set reward.models "
                                  f"and the placement with --set")
        return paths
    return transform


def _steps(flag: str, never: Any = None) -> Callable[[Any], Any]:
    """A count of steps is kept; OpenRLHF's -1 becomes `never` where hpc_rlhf has that, else it is refused (for
    evaluation it means once per epoch)."""
    def transform(value: Any) -> Any:
        if value <= 0 and never is not None:
            return never
        if value <= 0:
            raise ConversionError(f"{flag} {value}: OpenRLHF then uses no fixed interval (once per epoch, or "
                                  f"never); hpc_rlhf counts steps: give a positive interval, or set the key with "
                                  f"--set")
        return value
    return transform


def _symmetric_clip(value: Any) -> float:
    low, high = value
    if low != -high or high <= 0:
        raise ConversionError(f"--reward_clip_range {low:g} {high:g}: hpc_rlhf clips the score to a symmetric "
                              f"range [-reward.clip, reward.clip]")
    return float(high)


SCHEDULERS = ("cosine_with_min_lr", "constant_with_warmup")


def keep_per(template: str, what: str) -> Callable[["Conversion", Any], None]:
    """Keep the value for each training section of `template` (the schedule: Conversion._schedule)."""
    def apply(conv: "Conversion", value: Any) -> None:
        if what == "scheduler" and value not in SCHEDULERS:
            raise ConversionError(f"{conv.flag} {value}: hpc_rlhf's schedule is warmup, then cosine to a floor; the "
                                  f"converter takes cosine_with_min_lr or constant_with_warmup")
        for section in _sections(conv.mode, template):
            if (section, what) in conv.kept and conv.kept[(section, what)] != value:
                raise ConversionError(f"{conv.flag} {value} contradicts another flag that gave {section} "
                                      f"{conv.kept[(section, what)]}")
            conv.kept[(section, what)] = value
    return apply


def _target_modules(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    if names == ["all-linear"] or not names:
        raise ConversionError("--target_modules all-linear: hpc_rlhf adapts the modules named in "
                              "lora.target_modules: name them (e.g. q_proj k_proj v_proj o_proj gate_proj up_proj "
                              "down_proj)")
    return names


def _lora_rank(conv: "Conversion", value: Any) -> None:
    to("{model}.lora.rank")(conv, value)
    conv.kept["lora_rank"] = value


def _param_dtype(conv: "Conversion", value: Any) -> None:
    to("{model}.dtype", _choice(DTYPES, "--param_dtype"))(conv, value)


def _attention(conv: "Conversion", value: Any) -> None:
    if value not in ATTENTION:
        raise ConversionError(f"--attn_implementation {value}: hpc_rlhf takes {', '.join(ATTENTION)}")
    to("{model}.attn_implementation")(conv, value)


def _eps_clip_low_high(conv: "Conversion", value: Any) -> None:
    conv.set("rl.clip_eps", float(value[0]))
    conv.set("rl.clip_eps_high", float(value[1]))


def _adam_betas(template: str) -> Callable[["Conversion", Any], None]:
    def apply(conv: "Conversion", value: Any) -> None:
        for section in _sections(conv.mode, template):
            conv.set(f"{section}.adam_beta1", float(value[0]))
            conv.set(f"{section}.adam_beta2", float(value[1]))
    return apply


def _switch_true(template: str) -> Callable[["Conversion", Any], None]:
    return to(template, lambda _: True)


NO_TENSOR_PARALLEL = ("hpc_rlhf trains without tensor parallelism (its sequence parallelism is --ring_attn_size's, for "
                      "PPO); only the value 1 (off) is accepted")
NO_SEQUENCE_PARALLEL = ("hpc_rlhf splits rows over ranks only for the RL roles (placement keys actor_sp, critic_sp, "
                        "ref_sp, reward_sp); the one-model modes train whole rows: only the value 1 (off) is accepted")
HEAD_STRIDE = ("the ranks sharing a row exchange whole attention heads by all-to-all (Ulysses: each computes its share "
               "of the heads over the whole row), not a ring of key/value blocks, so there is no head stride to set; "
               "--ring_attn_size says how many ranks share a row")
PER_EPOCH = ("hpc_rlhf counts optimizer steps, not passes over the data: give --set train.max_steps=N "
             "(N = epochs x rows / train_batch_size)")
LOCAL_DATA = "local files or folders (hpc_rlhf reads no hub data set by name); a comma list gives several"
LOCAL_MODEL = "a local Hugging Face folder (hpc_rlhf downloads nothing)"
HUB_SPLIT = "the split of a hub data set; a local file has only its rows: accepted when it is 'train'"


def _flags() -> list[Flag]:
    F = Flag
    ppo, dpo, rm, prm, sft, kd = ("ppo",), ("dpo",), ("rm",), ("prm",), ("sft",), ("kd",)
    on_sft_data = ("sft", "kd")  # train_kd reads train_sft's rows
    flags = [
        # ---- placement (PPO): counts worked out in Conversion.placement()
        F(("--actor_num_nodes", "--actor.num_nodes"), ppo, cast=int, keys="placement: actor",
          apply=keep("actor_nodes"),
          note="ranks of the actor = nodes x GPUs per node (OpenRLHF's default 1 x 8)"),
        F(("--actor_num_gpus_per_node", "--actor.num_gpus_per_node"), ppo, cast=int, keys="placement: actor",
          apply=keep("actor_gpus")),
        F(("--critic_num_nodes", "--critic.num_nodes"), ppo, cast=int, keys="placement: critic",
          apply=keep("critic_nodes"), note="a critic only with --advantage_estimator gae, as in OpenRLHF"),
        F(("--critic_num_gpus_per_node", "--critic.num_gpus_per_node"), ppo, cast=int, keys="placement: critic",
          apply=keep("critic_gpus")),
        F(("--ref_num_nodes", "--ref.num_nodes"), ppo, cast=int, keys="placement: ref", apply=keep("ref_nodes"),
          note="a reference only when rl.kl_coef > 0, as in OpenRLHF (--init_kl_coef)"),
        F(("--ref_num_gpus_per_node", "--ref.num_gpus_per_node"), ppo, cast=int, keys="placement: ref",
          apply=keep("ref_gpus")),
        F(("--reward_num_nodes", "--reward.num_nodes"), ppo, cast=int, keys="placement: reward",
          apply=keep("reward_nodes")),
        F(("--reward_num_gpus_per_node", "--reward.num_gpus_per_node"), ppo, cast=int, keys="placement: reward",
          apply=keep("reward_gpus")),
        F(("--vllm_num_engines", "--vllm.num_engines"), ppo, cast=int,
          keys="placement: rollout = engines x TP; rollout.backend=vllm", apply=keep("engines"),
          note="0 or absent: the actor generates with transformers on its own ranks (rollout@actor, backend hf)"),
        F(("--vllm_tensor_parallel_size", "--vllm.tensor_parallel_size"), ppo, cast=int,
          keys="placement: rollout_tp", apply=keep("tp")),
        F(("--colocate_actor_ref", "--train.colocate_actor_ref"), ppo, takes="switch", keys="placement: actor+ref=N",
          apply=keep("colocate_actor_ref"), note="the two counts must be equal, as OpenRLHF asserts"),
        F(("--colocate_critic_reward", "--train.colocate_critic_reward"), ppo, takes="switch",
          keys="placement: critic+reward=N", apply=keep("colocate_critic_reward")),
        F(("--colocate_all_models", "--train.colocate_all"), ppo, takes="switch",
          keys="placement: actor+critic+ref+reward=N, rollout@actor", apply=keep("colocate_all"),
          note="the vLLM engines run on the actor's ranks (hpc_rlhf's hybrid engine): engines x TP must equal the "
               "actor's ranks, as OpenRLHF asserts"),
        F(("--vllm_gpu_memory_utilization", "--vllm.gpu_memory_utilization"), ppo, cast=float,
          keys="rollout.gpu_memory_utilization", apply=to("rollout.gpu_memory_utilization")),
        F(("--enforce_eager", "--vllm.enforce_eager"), ppo, takes="switch", keys="rollout.enforce_eager",
          apply=_switch_true("rollout.enforce_eager")),
        F(("--vllm_sync_backend", "--vllm.sync_backend"), ppo,
          ignored="how weights reach the engines: hpc_rlhf broadcasts them over its weight-sync group (NCCL on GPUs)"),
        F(("--vllm_sync_with_ray", "--vllm.sync_with_ray"), ppo, takes="switch", ignored="there is no Ray here"),
        F(("--enable_prefix_caching", "--vllm.enable_prefix_caching"), ppo, takes="switch",
          ignored="a speed setting of vLLM (computed prompt prefixes reused); it computes the same distribution"),
        F(("--vllm_enable_sleep", "--vllm.enable_sleep"), ppo, takes="switch",
          ignored="hpc_rlhf's hybrid vLLM engine always sleeps while the actor trains (rl/sync.py engine_awake)"),
        F(("--vllm_generate_batch_size", "--rollout.vllm_generate_batch_size"), ppo, cast=int,
          refused="no equivalent: a vLLM engine generates its whole share of a step in one call"),
        F(("--deepspeed_enable_sleep", "--ds.enable_sleep"), ppo, takes="switch",
          refused="no equivalent (DeepSpeed states are not offloaded while the engines generate)"),
        # ---- models
        F(("--pretrain", "--actor.model_name_or_path"), ppo, keys="actor.path", apply=to("actor.path"),
          note=LOCAL_MODEL),
        F(("--pretrain", "--model.model_name_or_path"), ONE_MODEL, keys="model.path", apply=to("model.path"),
          note=LOCAL_MODEL),
        F(("--reward_pretrain", "--reward.model_name_or_path"), ppo, keys="reward.models",
          apply=to("reward.models", _one_path("--reward_pretrain")), note=LOCAL_MODEL + "; one reward model"),
        F(("--critic_pretrain", "--critic.model_name_or_path"), ppo, keys="critic.path", apply=to("critic.path"),
          note="absent: the reward model's folder (the actor's without one), as in OpenRLHF"),
        F(("--ref_pretrain", "--ref.model_name_or_path"), dpo, keys="ref.path", apply=to("ref.path"),
          note=LOCAL_MODEL),
        F(("--remote_rm_url", "--reward.remote_url"), ppo,
          refused="OpenRLHF's remote reward protocol (query, prompts, labels) and its reward_func files differ from "
                  "hpc_rlhf's (reward.http_url: prompts, responses, answers; reward.functions: file.py:function): "
                  "serve a reward model folder with `hpc-rlhf serve-rm`, or port the function, and give it with "
                  "--set reward.http_url=... or reward.functions=[...]"),
        F(("--agent_func_path", "--train.agent_func_path"), ppo,
          refused="agents: hpc_rlhf's environments (env.name, env.http_url) have another interface: port it"),
        F(("--value_head_prefix", "--ds.value_head_prefix"), ("ppo", "rm"), noop=("score",),
          refused="hpc_rlhf's value models keep their head under its own name; only OpenRLHF's default 'score' "
                  "is accepted"),
        F(("--save_value_network", "--critic.save_value_network"), ppo, takes="switch",
          ignored="hpc_rlhf always saves the critic (output_dir/final_critic)"),
        # ---- precision, memory, attention
        F(("--bf16",), ALL, takes="switch", keys="{model}.dtype=bfloat16",
          apply=to("{model}.dtype", lambda _: "bfloat16")),
        F(("--param_dtype", "--ds.param_dtype"), ALL, keys="{model}.dtype", apply=_param_dtype,
          note="bf16 -> bfloat16, fp16 -> float16"),
        F(("--flash_attn",), ALL, takes="switch", keys="{model}.attn_implementation=flash_attention_2",
          apply=to("{model}.attn_implementation", lambda _: "flash_attention_2")),
        F(("--attn_implementation", "--ds.attn_implementation"), ALL, keys="{model}.attn_implementation",
          apply=_attention),
        F(("--gradient_checkpointing", "--actor.gradient_checkpointing_enable",
           "--model.gradient_checkpointing_enable"), ALL, takes="switch", keys="{model}.gradient_checkpointing",
          apply=_switch_true("{model}.gradient_checkpointing")),
        F(("--gradient_checkpointing_use_reentrant", "--actor.gradient_checkpointing_reentrant",
           "--model.gradient_checkpointing_reentrant"), ALL, takes="switch",
          ignored="which implementation of activation recomputation; the gradients are the same"),
        F(("--zero_stage", "--ds.zero_stage"), ALL, cast=int, keys="{train}.zero_stage",
          apply=to("{train}.zero_stage")),
        F(("--adam_offload", "--ds.adam_offload"), ALL, takes="switch", keys="{train}.adam_offload",
          apply=_switch_true("{train}.adam_offload")),
        F(("--zpg", "--ds.zpg"), ALL, cast=int, noop=(1,), refused="no ZeRO++ hierarchical partitioning setting"),
        F(("--dist_backend",), ALL, noop=("deepspeed",),
          refused="the trained roles run on DeepSpeed ZeRO; there is no FSDP backend: only 'deepspeed' is accepted"),
        F(("--overlap_comm", "--ds.overlap_comm"), ALL, takes="switch",
          ignored="a DeepSpeed speed setting (communication overlapped with computation)"),
        F(("--grad_accum_dtype", "--ds.grad_accum_dtype"), ALL,
          refused="no equivalent: gradients accumulate in the training dtype's DeepSpeed default"),
        F(("--ring_attn_size", "--ds.ring_attn_size"), ppo, cast=int,
          keys="placement: actor_sp, critic_sp, ref_sp, reward_sp; rl.padding_free", apply=_ring_attn_size,
          note="K ranks of every trained and scoring role share one packed row (as OpenRLHF's ring attention, "
               "which packs samples too); their heads travel by all-to-all (Ulysses) instead of a ring"),
        F(("--ring_attn_size", "--ds.ring_attn_size"), ONE_MODEL, cast=int, noop=(1,), refused=NO_SEQUENCE_PARALLEL),
        F(("--ring_head_stride", "--ds.ring_attn_head_stride"), ALL, cast=int, ignored=HEAD_STRIDE),
        F(("--ds_tensor_parallel_size", "--ds.tensor_parallel_size"), ALL, cast=int, noop=(1,),
          refused=NO_TENSOR_PARALLEL),
        F(("--use_liger_kernel", "--ds.use_liger_kernel"), ALL, takes="switch", refused="no Liger kernels here"),
        F(("--deepcompile", "--ds.deepcompile"), ALL, takes="switch", refused="no DeepCompile here"),
        F(("--packing_samples", "--ds.packing_samples"), ALL, takes="switch", keys="data.packing; rl.padding_free",
          apply=lambda c, v: _packing(c), note="PPO: rl.padding_free (rows of real tokens in scoring and training); "
                                               "SFT and KD: data.packing; DPO, RM and PRM: nothing (they train padded "
                                               "rows here; packing changes only their speed)"),
        F(("--use_dynamic_batch", "--train.dynamic_batch_enable"), ppo, takes="switch",
          keys="rl.micro_batch_tokens, rl.score_micro_batch_tokens", apply=_keep_switch("dynamic_batch"),
          note="micro-batches by token count: --train_max_tokens_per_gpu (default 16192) for training, "
               "--rollout_max_tokens_per_gpu (default: the training one) for scoring"),
        F(("--rollout_max_tokens_per_gpu", "--rollout.max_tokens_per_gpu"), ppo, cast=int,
          keys="rl.score_micro_batch_tokens", apply=_keep("rollout_max_tokens"),
          note="read only with --use_dynamic_batch, as OpenRLHF does"),
        F(("--train_max_tokens_per_gpu", "--train.max_tokens_per_gpu"), ppo, cast=int,
          keys="rl.micro_batch_tokens", apply=_keep("train_max_tokens"),
          note="read only with --use_dynamic_batch, as OpenRLHF does"),
        F(("--ref_reward_offload",), ppo, takes="switch", refused="no offloading of the reference or reward model"),
        F(("--ref.offload",), ppo, takes="switch", refused="no offloading of the reference model"),
        F(("--reward.offload",), ppo, takes="switch", refused="no offloading of the reward model"),
        F(("--ref_offload",), dpo, takes="switch",
          refused="no offloading of the reference (ref.mode=precompute scores the data once and frees it instead: "
                  "--set ref.mode=precompute)"),
        F(("--actor_init_on_gpu",), ppo, takes="switch", refused="no equivalent (models load where their rank runs)"),
        F(("--disable_fast_tokenizer", "--data.disable_fast_tokenizer"), ALL, takes="switch",
          refused="hpc_rlhf always loads the fast tokenizer"),
        F(("--dataloader_num_workers", "--data.dataloader_num_workers"), ALL, cast=int,
          ignored="worker processes for reading data: a speed setting"),
        F(("--full_determinism", "--train.full_determinism_enable"), ALL, takes="switch",
          refused="no equivalent switch (a seeded CPU run of hpc_rlhf repeats bit for bit; on GPUs nothing is forced)"),
        F(("--use_ds_universal_ckpt", "--ds.use_universal_ckpt"), ALL, takes="switch",
          refused="hpc_rlhf writes its own checkpoint format (resumable at another world size: no)"),
        # ---- LoRA
        F(("--lora_rank", "--ds.lora.rank"), ALL, cast=int, keys="{model}.lora.rank", apply=_lora_rank,
          note="PPO: the actor and the critic, as in OpenRLHF; with a reference role, ref_mode=model (OpenRLHF's "
               "reference is a model of its own)"),
        F(("--lora_alpha", "--ds.lora.alpha"), ALL, cast=float, keys="{model}.lora.alpha",
          apply=to("{model}.lora.alpha")),
        F(("--lora_dropout", "--ds.lora.dropout"), ALL, cast=float, keys="{model}.lora.dropout",
          apply=to("{model}.lora.dropout")),
        F(("--target_modules", "--ds.lora.target_modules"), ALL, takes="list", keys="{model}.lora.target_modules",
          apply=to("{model}.lora.target_modules", _target_modules),
          note="needed with --lora_rank: OpenRLHF's default all-linear is refused (hpc_rlhf adapts named modules)"),
        F(("--load_in_4bit", "--ds.load_in_4bit"), ALL, takes="switch", keys="{model}.lora.load_in_4bit",
          apply=_switch_true("{model}.lora.load_in_4bit")),
        # ---- data
        F(("--prompt_data", "--data.prompt_dataset"), ppo, keys="data.train_files",
          apply=to("data.train_files", _paths),
          note=LOCAL_DATA),
        F(("--dataset", "--data.dataset"), ONE_MODEL, keys="data.train_files", apply=to("data.train_files", _paths),
          note=LOCAL_DATA),
        F(("--eval_dataset", "--eval.dataset"), ALL, keys="data.eval_files", apply=to("data.eval_files", _paths),
          note=LOCAL_DATA + "; PPO: hpc_rlhf's evaluation is greedy held-out exact match on data.answer_key, not "
                            "OpenRLHF's sampled reward (--eval_temperature, --eval_n_samples_per_prompt: refused)"),
        F(("--prompt_data_probs", "--data.prompt_probs"), ppo, refused="no sampling probabilities between data files"),
        F(("--dataset_probs", "--data.dataset_probs"), ONE_MODEL,
          refused="no sampling probabilities between data files"),
        F(("--prompt_split", "--data.prompt_split"), ppo, noop=("train",), refused=HUB_SPLIT),
        F(("--dataset_split", "--data.dataset_split"), ONE_MODEL, noop=("train",), refused=HUB_SPLIT),
        F(("--train_split",), sft, noop=("train",), refused=HUB_SPLIT),
        F(("--eval_split", "--eval.split"), ALL, noop=("train",), refused=HUB_SPLIT),
        F(("--input_key", "--data.input_key"), ("ppo", *on_sft_data), keys="data.prompt_key",
          apply=to("data.prompt_key")),
        F(("--input_key", "--data.input_key"), prm, keys="data.input_key", apply=to("data.input_key"),
          note="the solution text, a marker after each step"),
        F(("--label_key", "--data.label_key"), prm, keys="data.label_key", apply=to("data.label_key"),
          note="the list of step labels"),
        F(("--placeholder_token",), prm, core=True, keys="prm.placeholder_token", apply=to("prm.placeholder_token"),
          note="one token of the tokenizer"),
        F(("--reward_tokens",), prm, core=True, takes="list", keys="prm.reward_tokens", apply=to("prm.reward_tokens"),
          note="the right-step token first; without the flag OpenRLHF fits the whole vocabulary, hpc_rlhf keeps its "
               "default [+, -]"),
        F(("--prompt_key", "--data.prompt_key"), ("dpo", "rm"), keys="data.prompt_key", apply=to("data.prompt_key")),
        F(("--output_key", "--data.output_key"), on_sft_data, keys="data.response_key", apply=to("data.response_key")),
        F(("--label_key", "--data.label_key"), ppo, keys="data.answer_key", apply=to("data.answer_key"),
          note="the reference answer the reward functions get"),
        F(("--chosen_key", "--data.chosen_key"), ("dpo", "rm"), keys="data.chosen_key", apply=to("data.chosen_key")),
        F(("--rejected_key", "--data.rejected_key"), ("dpo", "rm"), keys="data.rejected_key",
          apply=to("data.rejected_key")),
        F(("--apply_chat_template", "--data.apply_chat_template"), ALL, takes="switch",
          keys="data.apply_chat_template", apply=_switch_true("data.apply_chat_template")),
        F(("--input_template", "--data.input_template"), ALL,
          refused="no prompt templates: write the prompts as the model should see them, or use "
                  "--apply_chat_template"),
        F(("--tokenizer_chat_template", "--data.tokenizer_chat_template"), ONE_MODEL,
          refused="the chat template is the tokenizer's own (put another in the tokenizer folder)"),
        F(("--multiturn", "--data.multiturn"), sft, takes="switch",
          refused="OpenRLHF's compacted multi-turn rows differ from hpc_rlhf's chats (data.messages_key)"),
        F(("--max_samples", "--data.max_samples"), ALL, cast=int, keys="data.max_train_rows",
          apply=to("data.max_train_rows"), note="the first N rows"),
        F(("--max_len", "--data.max_len"), ALL, cast=int, keys="data.max_len (and data.max_prompt_len)",
          apply=keep("max_len"),
          note="one-model modes: OpenRLHF limits only the whole sequence, so data.max_prompt_len = max_len - 1; "
               "PPO: prompt + response, with data.max_prompt_len = max_len - new tokens (a longer prompt is cut "
               "from the left here, where OpenRLHF generates fewer tokens after it)"),
        F(("--prompt_max_len",), ppo, cast=int, keys="data.max_prompt_len", apply=keep("prompt_len"),
          note="longer prompts are cut from the left"),
        F(("--generate_max_len", "--max_new_tokens", "--rollout.max_new_tokens"), ppo, cast=int,
          keys="rollout.max_new_tokens", apply=keep("new_tokens")),
        # ---- batch sizes and lengths of training
        F(("--micro_train_batch_size", "--train.micro_batch_size"), ALL, core=True, cast=int,
          keys="{train}.micro_batch_size", apply=to("{train}.micro_batch_size")),
        F(("--train_batch_size", "--train.batch_size"), ALL, core=True, cast=int, keys="{train}.batch_size",
          apply=to("{train}.batch_size"), note="sequences per optimizer step over all ranks, as in OpenRLHF"),
        F(("--micro_rollout_batch_size", "--rollout.micro_batch_size"), ppo, cast=int,
          ignored="only how the inference passes after generation are chunked; hpc_rlhf scores in micro-batches "
                  "of train.micro_batch_size"),
        F(("--rollout_batch_size", "--rollout.batch_size"), ppo, core=True, cast=int, keys="rollout.prompts_per_step",
          apply=to("rollout.prompts_per_step"), note="prompts per RL step"),
        F(("--n_samples_per_prompt", "--rollout.n_samples_per_prompt"), ppo, core=True, cast=int,
          keys="rollout.n_samples", apply=to("rollout.n_samples")),
        F(("--max_epochs", "--train.max_epochs"), ppo, core=True, cast=int, keys="rl.ppo_epochs",
          apply=to("rl.ppo_epochs"), note="PPO: passes over each step's experience"),
        F(("--max_epochs", "--train.max_epochs"), ONE_MODEL, cast=int, refused=PER_EPOCH, lifted_by="train.max_steps"),
        F(("--num_episodes", "--train.num_episodes"), ppo, cast=int, lifted_by="train.max_steps",
          refused="hpc_rlhf counts RL steps, not passes over the prompts: give --set train.max_steps=N "
                  "(N = episodes x prompts / rollout_batch_size)"),
        F(("--seed", "--train.seed"), ALL, core=True, cast=int, keys="{train}.seed", apply=to("{train}.seed")),
        # ---- optimizer and schedule
        F(("--actor_learning_rate", "--actor.adam.lr"), ppo, core=True, cast=float, keys="train.lr",
          apply=to("train.lr")),
        F(("--critic_learning_rate", "--critic.adam.lr"), ppo, core=True, cast=float, keys="critic_train.lr",
          apply=to("critic_train.lr")),
        F(("--learning_rate", "--adam.lr"), ONE_MODEL, core=True, cast=float, keys="train.lr", apply=to("train.lr")),
        F(("--l2", "--adam.weight_decay"), ALL, core=True, cast=float, keys="{train}.weight_decay",
          apply=to("{train}.weight_decay")),
        F(("--adam_betas", "--adam.betas"), ALL, core=True, takes="pair", cast=float,
          keys="{train}.adam_beta1, {train}.adam_beta2", apply=_adam_betas("{train}")),
        F(("--max_norm",), ALL, core=True, cast=float, keys="{train}.max_grad_norm", apply=to("{train}.max_grad_norm")),
        F(("--lr_scheduler",), ALL, core=True, keys="{train}.min_lr_ratio", apply=keep_per("{train}", "scheduler"),
          note="cosine_with_min_lr: the floor is --min_lr_ratio (0.1 when not given, OpenRLHF's); "
               "constant_with_warmup: 1.0"),
        F(("--min_lr_ratio",), ONE_MODEL, cast=float, keys="train.min_lr_ratio", apply=keep_per("train", "floor"),
          note="the floor of cosine_with_min_lr"),
        F(("--lr_warmup_ratio",), ALL, cast=float, noop=(0.0,), lifted_by="train.warmup_steps",
          refused="hpc_rlhf's warmup is a number of steps (train.warmup_steps, RL steps in PPO): give "
                  "--set train.warmup_steps=N"),
        F(("--aux_loss_coef", "--actor.aux_loss_coef", "--model.aux_loss_coef"),
          ("ppo", "rm", "prm", "sft", "kd", "dpo"),
          cast=float, noop=(0.0,), refused="no mixture-of-experts balancing loss"),
        F(("--enable_ema", "--train.enable_ema"), ppo, takes="switch", refused="no EMA of the weights"),
        F(("--ema_beta", "--train.ema_beta"), ppo, cast=float, refused="no EMA of the weights"),
        # ---- RL
        F(("--advantage_estimator", "--algo.advantage.estimator"), ppo, core=True, keys="rl.advantage",
          apply=lambda c, v: c.set("rl.advantage", _choice(ADVANTAGES, "--advantage_estimator")(v)),
          note="gae, reinforce -> reinforce_pp, rloo, reinforce_baseline -> reinforce_pp_baseline, group_norm -> "
               "grpo, dr_grpo"),
        F(("--init_kl_coef", "--algo.kl.init_coef"), ppo, core=True, cast=float, keys="rl.kl_coef",
          apply=to("rl.kl_coef")),
        F(("--kl_estimator", "--algo.kl.estimator"), ppo, core=True, keys="rl.kl_estimator",
          apply=to("rl.kl_estimator")),
        F(("--use_kl_loss", "--algo.kl.use_loss"), ppo, takes="switch", keys="rl.kl_in_reward=false",
          apply=keep("kl_loss"), note="absent: rl.kl_in_reward=true (the KL in the reward), written out"),
        F(("--kl_target", "--algo.kl.target"), ppo, cast=float, refused="no adaptive KL controller"),
        F(("--kl_horizon", "--algo.kl.horizon"), ppo, cast=int, refused="no adaptive KL controller"),
        F(("--no_advantage_std_norm", "--algo.advantage.no_std_norm"), ppo, takes="switch",
          refused="hpc_rlhf whitens advantages fully (rl.whiten_advantages) or not at all; OpenRLHF's option keeps "
                  "the mean subtraction"),
        F(("--gamma", "--algo.advantage.gamma"), ppo, core=True, cast=float, keys="rl.gamma", apply=to("rl.gamma")),
        F(("--lambd", "--algo.advantage.lambd"), ppo, core=True, cast=float, keys="rl.lam", apply=to("rl.lam")),
        F(("--eps_clip", "--actor.eps_clip"), ppo, core=True, cast=float, keys="rl.clip_eps", apply=to("rl.clip_eps")),
        F(("--eps_clip_low_high", "--actor.eps_clip_low_high"), ppo, takes="pair", cast=float,
          keys="rl.clip_eps, rl.clip_eps_high", apply=_eps_clip_low_high),
        F(("--dual_clip", "--actor.dual_clip"), ppo, cast=float, keys="rl.dual_clip", apply=to("rl.dual_clip")),
        F(("--value_clip", "--critic.value_clip"), ppo, core=True, cast=float, keys="rl.value_clip_eps",
          apply=to("rl.value_clip_eps")),
        F(("--policy_loss_type", "--actor.policy_loss_type"), ppo, keys="rl.policy_loss", apply=to("rl.policy_loss")),
        F(("--entropy_loss_coef", "--actor.entropy_coef"), ppo, cast=float, keys="rl.entropy_coef",
          apply=to("rl.entropy_coef")),
        F(("--ptx_coef",), ppo, cast=float,
          ignored="weighs a pre-training loss on --pretrain_data (not converted: refused as unknown); alone it has "
                  "no effect"),
        F(("--temperature", "--rollout.temperature"), ppo, core=True, cast=float, keys="rollout.temperature",
          apply=to("rollout.temperature")),
        F(("--top_p", "--rollout.top_p"), ppo, core=True, cast=float, keys="rollout.top_p", apply=to("rollout.top_p")),
        F(("--reward_clip_range", "--reward.clip_range"), ppo, takes="pair", cast=float, keys="reward.clip",
          apply=to("reward.clip", _symmetric_clip), note="a symmetric range only"),
        F(("--normalize_reward", "--reward.normalize_enable"), ppo, takes="switch",
          refused="the reward statistics OpenRLHF stores in its reward model's config are not read; hpc_rlhf's "
                  "reward.normalize uses those its rm mode stores"),
        F(("--overlong_buffer_len", "--reward.overlong_buffer_len"), ppo, cast=lambda v: int(float(v)),
          keys="rl.overlong_buffer", apply=to("rl.overlong_buffer")),
        F(("--overlong_penalty_factor", "--reward.overlong_penalty_factor"), ppo, cast=float,
          keys="rl.overlong_penalty", apply=to("rl.overlong_penalty")),
        F(("--stop_properly_penalty_coef", "--reward.stop_properly_penalty_coef"), ppo, cast=float,
          refused="no penalty for truncated samples (rl.overlong_filter leaves them out of the loss instead)"),
        F(("--dynamic_filtering", "--algo.dynamic_filtering_enable"), ppo, takes="switch",
          refused="OpenRLHF filters groups by a reward range; hpc_rlhf's rl.dynamic_sampling drops groups whose "
                  "samples share one reward: not the same rule (set it with --set if that is what you want)"),
        F(("--dynamic_filtering_reward_range", "--algo.dynamic_filtering_range"), ppo, takes="pair", cast=float,
          refused="only with --dynamic_filtering (refused)"),
        F(("--enable_vllm_is_correction", "--algo.advantage.is_correction_enable"), ppo, takes="switch",
          refused="OpenRLHF's tis clamps the ratio from both sides and icepop keeps the weight of the tokens it "
                  "keeps; hpc_rlhf's rl.is_correction modes differ in these details: set one with --set"),
        F(("--vllm_is_truncated_threshold", "--algo.advantage.is_correction_threshold"), ppo, takes="pair",
          cast=float, refused="only with --enable_vllm_is_correction (refused)"),
        F(("--vllm_is_correction_type", "--algo.advantage.is_correction_type"), ppo,
          refused="only with --enable_vllm_is_correction (refused)"),
        F(("--freezing_actor_steps", "--critic.freezing_steps"), ppo, cast=int, noop=(-1,),
          refused="no critic warm-up with a frozen actor"),
        F(("--async_train", "--train.async_enable"), ppo, takes="switch",
          refused="asynchronous RL is rl.max_staleness=K (the engines generate K batches ahead): set it with --set; "
                  "OpenRLHF's queue is not translated"),
        F(("--async_queue_size", "--train.async_queue_size"), ppo, cast=int,
          refused="only with --async_train (refused)"),
        F(("--partial_rollout", "--train.partial_rollout_enable"), ppo, takes="switch",
          refused="no partial rollouts: an engine's batch is generated by one version of the weights"),
        F(("--eval_temperature", "--eval.temperature"), ppo, cast=float,
          refused="hpc_rlhf evaluates greedily (held-out exact match)"),
        F(("--eval_n_samples_per_prompt", "--eval.n_samples_per_prompt"), ppo, cast=int,
          refused="hpc_rlhf evaluates one greedy response per prompt"),
        # ---- one-model losses
        F(("--beta", "--model.beta"), dpo, core=True, cast=float, keys="dpo.beta", apply=to("dpo.beta")),
        F(("--label_smoothing", "--model.label_smoothing"), dpo, core=True, cast=float, keys="dpo.label_smoothing",
          apply=to("dpo.label_smoothing"), note="cDPO"),
        F(("--ipo", "--model.ipo_enable"), dpo, takes="switch",
          refused="hpc_rlhf's IPO (dpo.loss_type=ipo) uses length-averaged log-probs; OpenRLHF's uses their sums"),
        F(("--nll_loss_coef", "--model.nll_loss_coef"), dpo, cast=float, noop=(0.0,),
          refused="hpc_rlhf's dpo.sft_weight averages the NLL over the batch's chosen tokens, OpenRLHF's over each "
                  "response first"),
        F(("--loss", "--model.loss_type"), rm, noop=("sigmoid",),
          refused="hpc_rlhf's reward model trains the Bradley-Terry (sigmoid) loss only"),
        F(("--margin_loss", "--model.margin_loss_enable"), rm, takes="switch", keys="rm.margin_key=margin",
          apply=to("rm.margin_key", lambda _: "margin"), note="OpenRLHF reads the margin from the 'margin' column"),
        F(("--compute_fp32_loss", "--model.compute_fp32_loss_enable"), rm, takes="switch",
          refused="no such switch (the loss is computed in the model's dtype)"),
        F(("--pretrain_mode", "--model.pretrain_mode_enable"), on_sft_data, takes="switch",
          refused="no loss on the prompt tokens: SFT trains on the responses"),
        F(("--teacher_model",), kd, core=True, keys="kd.teacher", apply=to("kd.teacher"), note=LOCAL_MODEL),
        F(("--kd_coef",), kd, core=True, cast=float, keys="kd.coef", apply=to("kd.coef"),
          note="the same mix: (1 - coef) x the data's next-token loss + coef x the cross-entropy to the teacher"),
        F(("--teacher_offload",), kd, takes="switch",
          refused="the frozen teacher stays on the GPU (sharded like the student with train.zero_stage=3); "
                  "no offload of it to the CPU"),
        # ---- checkpoints and logs
        F(("--save_path", "--ckpt.output_dir"), ALL, keys="output_dir", apply=to("output_dir"),
          note="the final model goes to output_dir/final (the critic to final_critic), checkpoints to "
               "output_dir/checkpoints"),
        F(("--ckpt_path", "--ckpt.path"), ALL,
          ignored="hpc_rlhf keeps its checkpoints in output_dir/checkpoints (output_dir: --save_path)"),
        F(("--save_steps", "--ckpt.save_steps"), ALL, cast=int, keys="checkpoint.every_steps",
          apply=to("checkpoint.every_steps", _steps("--save_steps", never=0)),
          note="PPO: RL steps, as OpenRLHF's; -1 -> 0 (no intermediate checkpoints); hpc_rlhf also writes one at the "
               "end and on preemption"),
        F(("--max_ckpt_num", "--ckpt.max_num"), ALL, core=True, cast=int, keys="checkpoint.keep",
          apply=to("checkpoint.keep")),
        F(("--max_ckpt_mem", "--ckpt.max_mem"), ALL, cast=float, refused="checkpoints are kept by count only "
                                                                           "(checkpoint.keep)"),
        F(("--load_checkpoint", "--ckpt.load_enable"), ALL, takes="switch", keys="checkpoint.resume=true",
          apply=_switch_true("checkpoint.resume"), note="hpc_rlhf resumes by default (a requeued job continues)"),
        F(("--save_hf_ckpt", "--ckpt.save_hf"), ALL, takes="switch", keys="checkpoint.save_hf=true",
          apply=_switch_true("checkpoint.save_hf"),
          note="each checkpoint of --save_steps also holds the trained models as Hugging Face folders "
               "(<checkpoint>/hf/<model>)"),
        F(("--disable_ds_ckpt", "--ckpt.disable_ds"), ALL, takes="switch",
          refused="checkpoints hold the optimizer states, which a resume needs"),
        F(("--best_metric_key", "--ckpt.best_metric_key"), ppo,
          refused="OpenRLHF's evaluation figures are not hpc_rlhf's: set checkpoint.best_metric to one of this "
                  "run's (eval_accuracy in RL; --set checkpoint.best_metric=eval_accuracy)"),
        F(("--logging_steps", "--logger.logging_steps"), ALL, core=True, cast=int, keys="log.every_steps",
          apply=to("log.every_steps")),
        F(("--eval_steps", "--eval.steps"), ALL, core=True, cast=int, keys="log.eval_every_steps",
          apply=to("log.eval_every_steps", _steps("--eval_steps"))),
        F(("--use_wandb", "--logger.wandb.key"), ALL, keys="log.wandb=online",
          apply=to("log.wandb", lambda _: "online"),
          note="the API key goes in WANDB_API_KEY, not in the config"),
        F(("--wandb_project", "--logger.wandb.project"), ALL, keys="log.wandb_project", apply=to("log.wandb_project")),
        F(("--wandb_run_name", "--logger.wandb.run_name"), ALL,
          refused="the W&B run is named after output_dir"),
        F(("--wandb_org", "--logger.wandb.org"), ALL, refused="no W&B entity setting (WANDB_ENTITY sets it)"),
        F(("--wandb_group", "--logger.wandb.group"), ALL, refused="no W&B group setting"),
        F(("--use_tensorboard", "--logger.tensorboard_dir"), ALL, keys="log.tensorboard=true",
          apply=to("log.tensorboard", lambda _: True), note="written under output_dir/tb, not to the folder given"),
        # ---- launchers and hubs
        F(("--local_rank",), ALL, cast=int,
          ignored="set by the deepspeed launcher; hpc_rlhf's ranks read theirs from their launcher"),
        F(("--use_ms",), ALL, takes="switch", ignored="a hub switch (ModelScope); model paths are local folders here"),
        F(("--perf",), ppo, takes="switch", ignored="prints OpenRLHF's throughput figures; hpc_rlhf logs time_* "
                                                    "and samples_per_s every step"),
    ]
    for role in ("actor", "critic"):  # the dotted names of 0.10.2 and later give each role its own optimizer
        train = "train" if role == "actor" else "critic_train"
        flags += [
            F((f"--{role}.adam.betas",), ppo, takes="pair", cast=float, keys=f"{train}.adam_beta1, {train}.adam_beta2",
              apply=_adam_betas(train)),
            F((f"--{role}.adam.weight_decay",), ppo, cast=float, keys=f"{train}.weight_decay",
              apply=to(f"{train}.weight_decay")),
            F((f"--{role}.max_norm",), ppo, cast=float, keys=f"{train}.max_grad_norm",
              apply=to(f"{train}.max_grad_norm")),
            F((f"--{role}.lr_scheduler",), ppo, keys=f"{train}.min_lr_ratio", apply=keep_per(train, "scheduler")),
            F((f"--{role}.min_lr_ratio",), ppo, cast=float, keys=f"{train}.min_lr_ratio",
              apply=keep_per(train, "floor")),
            F((f"--{role}.lr_warmup_ratio",), ppo, cast=float, noop=(0.0,), lifted_by=f"{train}.warmup_steps",
              refused=f"hpc_rlhf's warmup is a number of RL steps: give --set {train}.warmup_steps=N"),
            F((f"--{role}.optim",), ppo, noop=("adam",), refused="the optimizer is Adam(W); no Muon"),
        ]
    flags.append(F(("--optim",), ONE_MODEL, noop=("adam",), refused="the optimizer is Adam(W); no Muon"))
    return flags


def _keep(slot: str) -> Callable[["Conversion", Any], None]:
    """A flag whose key follows from others (Conversion.finish): its value kept until then."""
    def apply(conv: "Conversion", value: Any) -> None:
        if value < 1:
            raise ConversionError(f"{conv.flag} {value}: a micro-batch holds at least one token")
        conv.kept[slot] = value
    return apply


def _keep_switch(slot: str) -> Callable[["Conversion", Any], None]:
    def apply(conv: "Conversion", value: Any) -> None:
        conv.kept[slot] = bool(value)
    return apply


def _packing(conv: "Conversion") -> None:
    if conv.mode == "ppo":  # the RL step packs rows of real tokens (issue 37)
        conv.set("rl.padding_free", True)
    elif conv.mode in ("sft", "kd"):
        conv.set("data.packing", True)
    # dpo, rm, prm: they train padded rows here (data.packing is refused there); packing changes only their speed


def _ring_attn_size(conv: "Conversion", value: Any) -> None:
    if value < 1:
        raise ConversionError(f"--ring_attn_size {value}: the ranks sharing a row are at least 1")
    conv.kept["ring_attn_size"] = value


FLAGS: list[Flag] = _flags()


# The documentation's worked example: an OpenRLHF-style command for the layout of sbatch/ppo_70b.sbatch (4 nodes x 8
# GPUs: actor and critic 8 GPUs each, reference and reward model 4 each, 2 vLLM engines of tensor-parallel 4), and the
# --set keys that OpenRLHF expresses otherwise (its episodes and warmup ratio). Converted, it gives the keys of
# examples/cluster/ppo_70b.yaml (tests/test_openrlhf.py checks it).
EXAMPLE_70B = ("ppo", [
    "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "8", "--critic_num_nodes", "1",
    "--critic_num_gpus_per_node", "8", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "4",
    "--reward_num_nodes", "1", "--reward_num_gpus_per_node", "4",
    "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "4", "--vllm_gpu_memory_utilization", "0.85",
    "--pretrain", "/path/to/models/llama-2-70b-sft", "--reward_pretrain", "/path/to/models/llama-2-70b-rm",
    "--critic_pretrain", "/path/to/models/llama-2-70b-rm",
    "--prompt_data", "/path/to/data/prompts_train.jsonl", "--input_key", "prompt",
    "--zero_stage", "3", "--adam_offload", "--bf16", "--gradient_checkpointing",
    "--micro_train_batch_size", "1", "--train_batch_size", "64", "--micro_rollout_batch_size", "4",
    "--rollout_batch_size", "64", "--n_samples_per_prompt", "4", "--max_epochs", "1",
    "--prompt_max_len", "1024", "--generate_max_len", "1024", "--num_episodes", "1",
    "--actor_learning_rate", "1e-6", "--critic_learning_rate", "5e-6", "--lr_scheduler", "constant_with_warmup",
    "--lr_warmup_ratio", "0.01", "--init_kl_coef", "0.02", "--kl_estimator", "k1", "--advantage_estimator", "gae",
    "--temperature", "1.0", "--save_path", "/path/to/runs/ppo_70b", "--ckpt_path", "/path/to/runs/ppo_70b/ckpt",
    "--save_steps", "10", "--max_ckpt_num", "2", "--logging_steps", "1", "--load_checkpoint",
], ["train.max_steps=500", "critic_train.max_steps=500", "train.warmup_steps=5", "critic_train.warmup_steps=5"])


def flags_of(mode: str) -> dict[str, Flag]:
    """name -> Flag for the flags OpenRLHF's script of `mode` takes (every name, aliases included)."""
    table = {}
    for flag in FLAGS:
        if mode in flag.modes:
            for name in flag.names:
                table.setdefault(name, flag)
    return table


# ============================================================================================ the conversion
class Conversion:
    """The hpc_rlhf keys that the flags of one command set (`keys`, dotted), with what set each."""

    def __init__(self, mode: str, sets: dict[str, Any]):
        self.mode = mode
        self.sets = sets
        self.keys: dict[str, Any] = {}
        self.source: dict[str, str] = {}
        self.kept: dict[str, Any] = {}
        self.flag = ""  # the flag being applied, for messages
        self.ignored: list[tuple[str, str]] = []
        self.given: set[Flag] = set()

    def set(self, key: str, value: Any) -> None:
        if key in self.keys and self.keys[key] != value:
            raise ConversionError(f"{self.flag} sets {key}={value!r}, but {self.source[key]} set it to "
                                  f"{self.keys[key]!r}")
        self.keys[key], self.source[key] = value, self.flag

    def finish(self, defaults: Any) -> None:
        """What depends on several flags: lengths, the KL's place, the placement."""
        self._lengths()
        self._schedule()
        if self.kept.get("lora_rank", 0) > 0 and not any(k.endswith(".lora.target_modules") for k in self.keys):
            raise ConversionError("--lora_rank without --target_modules: OpenRLHF then adapts every linear layer "
                                  "(all-linear); hpc_rlhf adapts the modules named in lora.target_modules: name them "
                                  "with --target_modules")
        if self.mode == "ppo":
            self.set_derived("rl.kl_in_reward", not self.kept.get("kl_loss", False))
            self._roles_and_placement(defaults)
            if self.kept.get("dynamic_batch"):  # OpenRLHF's token budgets per GPU, its defaults
                self.flag = "--use_dynamic_batch"
                train_tokens = self.kept.get("train_max_tokens", OPENRLHF_TRAIN_MAX_TOKENS)
                self.set_derived("rl.micro_batch_tokens", train_tokens)
                self.set_derived("rl.score_micro_batch_tokens", self.kept.get("rollout_max_tokens", train_tokens))
        # OpenRLHF evaluates only on --eval_dataset (and SFT and DPO never by generation); hpc_rlhf's defaults are
        # the built-in tiny task's held-out files, which a converted run must not read.
        if "data.eval_files" not in self.keys:
            self.set_derived("data.eval_files", [])
        if self.mode in ("sft", "kd", "dpo"):
            self.set_derived("eval.prompt_files", [])
        for key, value in self.sets.items():
            if key in self.keys and self.keys[key] != value:
                raise ConversionError(f"--set {key}={value!r} contradicts {self.source[key]}, which sets "
                                      f"{key}={self.keys[key]!r}")
            self.keys[key], self.source[key] = value, "--set"

    def set_derived(self, key: str, value: Any) -> None:
        """A key that follows from several flags; a key given with --set is the user's instead."""
        if key not in self.sets:
            self.flag = "(derived)"
            self.set(key, value)

    def _schedule(self) -> None:
        """train.min_lr_ratio of each training section from --lr_scheduler and --min_lr_ratio (OpenRLHF's scheduler
        is cosine_with_min_lr with a floor of 0.1 x lr unless they say otherwise)."""
        for section in _sections(self.mode, "{train}"):
            scheduler = self.kept.get((section, "scheduler"))
            floor = self.kept.get((section, "floor"))
            self.flag = "--lr_scheduler"
            if scheduler == "constant_with_warmup":
                if floor is not None:
                    raise ConversionError(f"--min_lr_ratio {floor}: only with --lr_scheduler cosine_with_min_lr")
                self.set(f"{section}.min_lr_ratio", 1.0)
            elif scheduler == "cosine_with_min_lr" or floor is not None:
                self.set(f"{section}.min_lr_ratio", 0.1 if floor is None else floor)

    def _lengths(self) -> None:
        total, prompt, new = (self.kept.get(k) for k in ("max_len", "prompt_len", "new_tokens"))
        self.flag = "--max_len"
        if self.mode != "ppo":
            if total is not None:
                self.set("data.max_len", total)
                self.set("data.max_prompt_len", total - 1)
            return
        if new is not None:
            self.set("rollout.max_new_tokens", new)
        if prompt is not None:
            self.set("data.max_prompt_len", prompt)
            if total is None and new is not None:
                self.set("data.max_len", prompt + new)
        if total is not None:
            if new is None:
                raise ConversionError("--max_len without --max_new_tokens: OpenRLHF then generates up to max_len "
                                      "minus each prompt's length; hpc_rlhf generates at most rollout.max_new_tokens: "
                                      "give --max_new_tokens (or --generate_max_len)")
            self.set("data.max_len", total)
            if prompt is None:
                self.set("data.max_prompt_len", total - new)

    def _count(self, role: str) -> int:
        return (self.kept.get(f"{role}_nodes", ROLE_DEFAULT_NODES) * self.kept.get(f"{role}_gpus", ROLE_DEFAULT_GPUS))

    def _roles_and_placement(self, defaults: Any) -> None:
        def value(key: str) -> Any:
            return self.sets.get(key, self.keys.get(key, _get(defaults, key)))

        critic = value("rl.advantage") == "gae"
        ref = value("rl.kl_coef") > 0
        if "reward.models" not in self.keys:
            self.set_derived("reward.models", [])  # no --reward_pretrain: OpenRLHF has no reward model
        reward = bool(value("reward.models"))
        if critic and "critic.path" not in self.keys:
            # OpenRLHF: the critic starts from the reward model (from the actor without one).
            start = value("reward.models")[0] if reward else self.keys.get("actor.path")
            if start is not None:
                self.set_derived("critic.path", start)
        if not critic:
            for key in [k for k in self.keys if k.startswith(("critic.", "critic_train."))]:
                del self.keys[key]
        if ref and self.kept.get("lora_rank", 0) > 0:
            self.set_derived("ref_mode", "model")  # OpenRLHF's reference is a model of its own, on its own GPUs
        roles = {"actor": self._count("actor")}
        roles.update({name: self._count(name) for name, present in (("critic", critic), ("ref", ref),
                                                                     ("reward", reward)) if present})
        engines, tp = self.kept.get("engines") or 0, self.kept.get("tp", 1)
        self.flag = "--colocate_all_models" if self.kept.get("colocate_all") else "placement flags"
        groups: list[list[str]]
        if self.kept.get("colocate_all"):
            groups = [list(roles)]
        else:
            groups = [[r] for r in roles]
            for first, second, flag in (("actor", "ref", "colocate_actor_ref"), ("critic", "reward",
                                                                                 "colocate_critic_reward")):
                if self.kept.get(flag) and first in roles and second in roles:
                    groups.remove([second])
                    groups[groups.index([first])].append(second)
        parts = []
        for group in groups:
            counts = {roles[r] for r in group}
            if len(counts) > 1:
                raise ConversionError(f"--{'colocate_all_models' if len(group) > 2 else 'colocate_' + '_'.join(group)}"
                                      f": the colocated roles need as many GPUs each, got "
                                      f"{', '.join(f'{r} {roles[r]}' for r in group)}")
            parts.append(f"{'+'.join(group)}={roles[group[0]]}")
        if engines > 0 and self.kept.get("colocate_all"):
            if engines * tp != roles["actor"]:
                raise ConversionError(f"--colocate_all_models: vLLM engines x tensor parallel size ({engines} x {tp}) "
                                      f"must equal the actor's GPUs ({roles['actor']}), as OpenRLHF asserts")
            parts.append("rollout@actor")
        elif engines > 0:
            parts.append(f"rollout={engines * tp}")
        else:
            parts.append("rollout@actor")  # OpenRLHF without vLLM: the actor generates (transformers)
        if engines > 0 and tp > 1:
            parts.append(f"rollout_tp={tp}")
        sp = self.kept.get("ring_attn_size", 1)
        if sp > 1:
            self.flag = "--ring_attn_size"
            for name, count in roles.items():  # OpenRLHF's ring attention runs in every model of the job
                if count % sp:
                    raise ConversionError(f"--ring_attn_size {sp}: {name}_sp={sp} does not divide the {name}'s "
                                          f"{count} GPUs")
                parts.append(f"{name}_sp={sp}")
            self.set_derived("rl.padding_free", True)
        self.set_derived("placement", ",".join(parts))
        self.set_derived("rollout.backend", "vllm" if engines > 0 else "hf")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def parse_flags(mode: str, argv: list[str]) -> list[tuple[Flag, str, Any]]:
    """(flag, the name used, value) for each flag of `argv`, values read by the flag's cast."""
    table = flags_of(mode)
    found, i = [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConversionError(f"'{token}' is not a flag (a value without one, or a flag without its dashes)")
        name, eq, inline = token.partition("=")
        flag = table.get(name)
        if flag is None:
            others = [m for m in MODES if m != mode and name in flags_of(m)]
            if others:
                raise ConversionError(f"{name} is a flag of OpenRLHF's {SCRIPTS[others[0]]}, not of {SCRIPTS[mode]} "
                                      f"(--mode {mode})")
            near = difflib.get_close_matches(name, list(table), n=1)
            raise ConversionError(f"unknown OpenRLHF flag {name}" + (f"; did you mean {near[0]}?" if near else
                                                                    " (not converted: drop it or set the hpc_rlhf key "
                                                                    "with --set)"))
        i += 1
        values: list[str] = [inline] if eq else []
        wanted = {"switch": 0, "value": 1, "pair": 2}.get(flag.takes)
        if wanted is None:  # a list: values up to the next flag
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        else:
            while len(values) < wanted and i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            if len(values) != wanted:
                what = "no value" if wanted == 0 else f"{wanted} value{'s' if wanted > 1 else ''}"
                raise ConversionError(f"{name} takes {what}, got {len(values)}")
        try:
            cast = [flag.cast(v) for v in values]
        except ValueError:
            kind = getattr(flag.cast, "__name__", "value")
            raise ConversionError(f"{name} {' '.join(values)}: not a {kind}") from None
        value = True if flag.takes == "switch" else cast[0] if flag.takes == "value" else cast
        found.append((flag, name, value))
    return found


def convert(mode: str, argv: list[str], sets: dict[str, Any] | None = None) -> tuple[dict[str, Any], Conversion]:
    """The hpc_rlhf config (a nested dict, checked against the mode's Config) of OpenRLHF flags `argv`."""
    if mode not in MODES:
        raise ConversionError(f"--mode {mode}: one of {', '.join(MODES)}")
    config_class = mode_config(mode)
    known = set(all_keys(config_class))
    sets = dict(sets or {})
    for key in sets:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            raise ConversionError(f"--set {key}: not a key of hpc-rlhf {mode}" + (f"; did you mean {near[0]}?"
                                                                                   if near else ""))
    conv = Conversion(mode, sets)
    seen: dict[Flag, str] = {}
    for flag, name, value in parse_flags(mode, argv):
        if flag in seen:
            raise ConversionError(f"{name} is given twice" + (f" (also as {seen[flag]})" if seen[flag] != name else ""))
        seen[flag] = name
        conv.flag = name
        conv.given.add(flag)
        shown = value if not isinstance(value, list) else " ".join(map(str, value))
        if flag.apply is not None:
            flag.apply(conv, value)
        elif flag.ignored:
            conv.ignored.append((name, flag.ignored))
        elif value in flag.noop:
            conv.ignored.append((name, f"{shown} is what hpc_rlhf does"))
        elif flag.lifted_by and flag.lifted_by in sets:
            conv.ignored.append((name, f"replaced by --set {flag.lifted_by}={sets[flag.lifted_by]}"))
        else:
            raise ConversionError(f"{name}: {flag.refused}")
    conv.finish(config_class())
    tree = nest(conv.keys, config_class)
    try:
        from_dict(config_class, tree, "the converted flags")
    except ConfigError as exc:
        raise ConversionError(str(exc).split("\n")[0]) from None
    return tree, conv


def nest(keys: dict[str, Any], config_class) -> dict[str, Any]:
    """Dotted keys -> nested mapping, in the order of the Config's keys (as `--help` lists them)."""
    tree: dict[str, Any] = {}
    for key in all_keys(config_class):
        if key in keys:
            node = tree
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = keys[key]
    return tree


def render(mode: str, argv: list[str], tree: dict[str, Any], conv: Conversion) -> str:
    """The YAML with a header: where it came from, what was ignored, and which keys keep hpc_rlhf's defaults."""
    config_class = mode_config(mode)
    defaults = config_class()
    command = textwrap.wrap(" ".join(argv), 112, break_long_words=False, break_on_hyphens=False) or ["(no flags)"]
    lines = [f"# hpc-rlhf {mode} config converted from OpenRLHF's {SCRIPTS[mode]} flags by `{PROG}`:",
             *(f"#   {line}" for line in command),
             f"# Run it: hpc-rlhf {mode} --config THIS.yaml (check the layout first: add --dry-run --world-size N "
             f"--gpus-per-node G)."]
    for name, why in conv.ignored:
        lines.append(f"# ignored {name}: {why}")
    body = yaml.dump(tree, Dumper=_Dumper, sort_keys=False, width=120).rstrip("\n")
    defaulted = []
    for flag in FLAGS:
        if mode not in flag.modes or flag in conv.given or not flag.core:
            continue
        named = [part.split(" ")[0].split("=")[0] for part in flag.keys.split(", ")]
        keys = [k for part in named for k in _sections(conv.mode, part) if _has(defaults, k)]
        keys = [k for k in keys if k not in conv.keys]
        if keys:
            shown = ", ".join(f"{k}={_shown(_get(defaults, k))}" for k in keys)
            defaulted.append(f"#   {flag.name:<28} {shown}")
    tail = ["", "# Flags of the table not given here: their keys keep hpc_rlhf's defaults (not OpenRLHF's):",
            *defaulted] if defaulted else []
    return "\n".join(lines + [body] + tail) + "\n"


class _Dumper(yaml.SafeDumper):
    """Sections as blocks, lists on one line (as the example configs are written)."""


_Dumper.add_representer(list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value,
                                                                               flow_style=True))


def _has(obj: Any, dotted: str) -> bool:
    try:
        _get(obj, dotted)
        return True
    except AttributeError:
        return False


def _shown(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


# ================================================================================================ the table
def flag_table(mode: str) -> str:
    """The markdown table of OpenRLHF's `mode` script flags: name (aliases), hpc_rlhf key(s) or why not, notes."""
    rows = ["| OpenRLHF flag | hpc_rlhf | notes |", "|---|---|---|"]
    for flag in FLAGS:
        if mode not in flag.modes:
            continue
        names = " ".join(f"`{n}`" for n in dict.fromkeys(flag.names))
        if flag.kind == "mapped":
            target = ", ".join(f"`{k.strip()}`" for part in flag.keys.split(", ") for k in _sections(mode, part))
            if flag.keys.startswith("placement:"):
                target = f"`placement`:{flag.keys.removeprefix('placement:')}"
        elif flag.kind == "ignored":
            target = "ignored"
        else:
            target = "refused" + (f" (accepted with `--set {flag.lifted_by}`)" if flag.lifted_by else "")
        why = flag.note if flag.kind == "mapped" else (flag.ignored or flag.refused)
        if flag.noop:
            why += f" (accepted: {', '.join(str(v) for v in flag.noop)})"
        rows.append(f"| {names} | {target} | {why.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


# =============================================================================================== the command
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    parser = argparse.ArgumentParser(prog=PROG, usage=f"{PROG} [--mode ppo|dpo|rm|prm|sft|kd] [--set KEY=VALUE ...] "
                                                      f"-- <OpenRLHF flags>",
                                     description="Print the hpc_rlhf YAML config of an OpenRLHF command's flags "
                                                 "(train_ppo_ray, train_dpo, train_rm, train_prm, train_sft, "
                                                 "train_kd). Flags without an exact equivalent are refused by name.")
    parser.add_argument("--mode", default="ppo", choices=MODES, help="which OpenRLHF script the flags are for")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an hpc_rlhf key no flag gives (e.g. train.max_steps=500); repeatable")
    parser.add_argument("--table", action="store_true", help="print the flag table of --mode as markdown and exit")
    args = parser.parse_args(ours)
    if args.table:
        print(flag_table(args.mode), end="")
        return 0
    if theirs is None:
        print(f"{PROG}: give the OpenRLHF flags after --, e.g. {PROG} --mode ppo -- --pretrain /path/to/sft "
              f"--zero_stage 3", file=sys.stderr)
        return 2
    try:
        sets = dict(parse_override(text) for text in args.set)
        tree, conv = convert(args.mode, theirs, sets)
    except (ConversionError, ConfigError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print(render(args.mode, theirs, tree, conv), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
