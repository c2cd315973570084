"""`hpc-rlhf from-openrlhf`: OpenRLHF flags -> an hpc_rlhf config that loads with the mode's Config; flags without an
exact equivalent, and unknown ones, refused by name in one line (exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpc_rlhf.cli import main
from hpc_rlhf.config import load_config
from hpc_rlhf.launch.modes import mode_config
from hpc_rlhf.openrlhf import EXAMPLE_70B, FLAGS, MODES, flag_table, flags_of

REPO = Path(__file__).resolve().parents[1]


def converted(tmp_path: Path, capsys, mode: str, flags: list[str], sets: list[str] = ()):
    """(exit code, the printed YAML loaded with the mode's Config or None, stderr)."""
    code = main(["from-openrlhf", "--mode", mode, *[a for s in sets for a in ("--set", s)], "--", *flags])
    out, err = capsys.readouterr()
    if code != 0:
        return code, None, err
    path = tmp_path / f"{mode}.yaml"
    path.write_text(out)
    return code, load_config(mode_config(mode), path), err


def test_the_70b_ppo_command_converts_to_the_layout_of_sbatch_ppo_70b(tmp_path, capsys):
    """The worked example of the documentation: an OpenRLHF-style 70B PPO command next to sbatch/ppo_70b.sbatch
    with examples/cluster/ppo_70b.yaml."""
    mode, flags, sets = EXAMPLE_70B
    code, cfg, err = converted(tmp_path, capsys, mode, flags, sets)
    assert code == 0, err
    ours = load_config(mode_config("ppo"), REPO / "examples/cluster/ppo_70b.yaml")
    same = ["placement", "actor.path", "actor.gradient_checkpointing", "critic.path", "reward.models",
            "rollout.backend", "rollout.gpu_memory_utilization", "rollout.prompts_per_step", "rollout.n_samples",
            "rollout.max_new_tokens", "rollout.temperature", "rl.advantage", "rl.kl_coef", "rl.kl_estimator",
            "rl.kl_in_reward", "data.train_files", "data.max_prompt_len", "data.max_len", "train.zero_stage",
            "train.adam_offload", "train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.max_steps",
            "train.batch_size", "train.micro_batch_size", "critic_train.lr", "critic_train.batch_size",
            "critic_train.zero_stage", "checkpoint.every_steps", "checkpoint.keep", "output_dir"]

    def get(obj, key):
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    assert {k: get(cfg, k) for k in same} == {k: get(ours, k) for k in same}
    assert cfg.placement == "actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4"


@pytest.mark.parametrize("mode, flags, sets, expected", [
    ("ppo", ["--pretrain", "/m/sft", "--prompt_data", "/d/prompts.jsonl", "--advantage_estimator", "group_norm",
             "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", "1e-3", "--colocate_all_models",
             "--vllm_num_engines", "4", "--vllm_tensor_parallel_size", "2", "--actor_num_gpus_per_node", "8",
             "--ref_num_gpus_per_node", "8", "--n_samples_per_prompt", "8", "--rollout_batch_size", "128",
             "--train_batch_size", "1024", "--micro_train_batch_size", "4", "--max_len", "2048",
             "--max_new_tokens", "1024", "--label_key", "answer", "--vllm_enable_sleep"],
     ["train.max_steps=100", "reward.functions=[exact_match]"],
     {"placement": "actor+ref=8,rollout@actor,rollout_tp=2", "rl.advantage": "grpo", "rl.kl_in_reward": False,
      "rl.kl_estimator": "k3", "data.max_prompt_len": 1024, "rollout.backend": "vllm", "reward.models": []}),
    ("ppo", ["--pretrain", "/m/sft", "--reward_pretrain", "/m/rm", "--ds.zero_stage", "2", "--actor.adam.lr", "2e-6",
             "--colocate_actor_ref", "--colocate_critic_reward", "--prompt_max_len", "512", "--generate_max_len", "256",
             "--micro_train_batch_size", "4", "--train_batch_size", "64", "--rollout_batch_size", "32",
             "--n_samples_per_prompt", "2", "--eps_clip_low_high", "0.2", "0.28",
             "--lr_scheduler", "cosine_with_min_lr"],
     [],
     {"placement": "actor+ref=8,critic+reward=8,rollout@actor", "critic.path": "/m/rm", "train.zero_stage": 2,
      "critic_train.zero_stage": 2, "train.lr": 2e-6, "rl.clip_eps_high": 0.28, "data.max_len": 768,
      "train.min_lr_ratio": 0.1, "rollout.backend": "hf"}),
    ("dpo", ["--pretrain", "/m/sft", "--ref_pretrain", "/m/sft", "--dataset", "/d/a.jsonl,/d/b.jsonl",
             "--max_len", "1024", "--train_batch_size", "128", "--micro_train_batch_size", "2",
             "--learning_rate", "5e-7",
             "--beta", "0.1", "--label_smoothing", "0.1", "--zero_stage", "3", "--bf16", "--flash_attn",
             "--gradient_checkpointing", "--save_path", "/r/dpo", "--save_steps", "-1", "--max_epochs", "1",
             "--lr_scheduler", "cosine_with_min_lr", "--min_lr_ratio", "0.05"],
     ["train.max_steps=300"],
     {"data.train_files": ["/d/a.jsonl", "/d/b.jsonl"], "dpo.label_smoothing": 0.1, "model.dtype": "bfloat16",
      "model.attn_implementation": "flash_attention_2", "checkpoint.every_steps": 0, "train.min_lr_ratio": 0.05,
      "data.max_prompt_len": 1023, "output_dir": "/r/dpo"}),
    ("rm", ["--pretrain", "/m/sft", "--dataset", "/d/pref.jsonl", "--margin_loss", "--loss", "sigmoid",
            "--train_batch_size", "128", "--micro_train_batch_size", "4", "--lora_rank", "8", "--lora_alpha", "16",
            "--target_modules", "q_proj", "v_proj", "--packing_samples"],
     [], {"rm.margin_key": "margin", "model.lora.target_modules": ["q_proj", "v_proj"], "model.lora.alpha": 16.0,
          "data.packing": False}),  # rm trains padded rows here: packing changes only OpenRLHF's speed
    ("prm", ["--pretrain", "/m/sft", "--dataset", "/d/steps.jsonl", "--input_key", "input", "--label_key", "value",
             "--placeholder_token", "ки", "--reward_tokens", "+", "-", "--max_len", "2048", "--train_batch_size", "64",
             "--micro_train_batch_size", "2", "--learning_rate", "2e-6", "--zero_stage", "3", "--bf16",
             "--packing_samples"],
     [], {"data.train_files": ["/d/steps.jsonl"], "data.input_key": "input", "data.label_key": "value",
          "prm.placeholder_token": "ки", "prm.reward_tokens": ["+", "-"], "data.packing": False, "train.lr": 2e-6,
          "train.zero_stage": 3, "model.dtype": "bfloat16", "data.max_len": 2048}),
    ("sft", ["--pretrain", "/m/base", "--dataset", "/d/sft.jsonl", "--input_key", "q", "--output_key", "a",
             "--max_len", "2048", "--train_batch_size", "256", "--micro_train_batch_size", "8", "--packing_samples",
             "--adam_betas", "0.9", "0.98", "--l2", "0.01", "--seed", "7"],
     [], {"data.response_key": "a", "data.packing": True, "train.adam_beta2": 0.98, "train.weight_decay": 0.01,
          "train.seed": 7}),
    ("kd", ["--pretrain", "/m/student", "--teacher_model", "/m/teacher", "--kd_coef", "0.5", "--dataset", "/d/sft.jsonl",
            "--input_key", "q", "--output_key", "a", "--max_len", "4096", "--train_batch_size", "128",
            "--micro_train_batch_size", "4", "--learning_rate", "5e-6", "--zero_stage", "3", "--bf16"],
     [], {"model.path": "/m/student", "kd.teacher": "/m/teacher", "kd.coef": 0.5, "data.prompt_key": "q",
          "data.response_key": "a", "data.max_len": 4096, "train.zero_stage": 3, "eval.prompt_files": [],
          "data.eval_files": []}),
])
def test_each_modes_flags_convert_to_a_config_that_loads(tmp_path, capsys, mode, flags, sets, expected):
    code, cfg, err = converted(tmp_path, capsys, mode, flags, sets)
    assert code == 0, err
    for key, value in expected.items():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == value, key


@pytest.mark.parametrize("mode, flags, message", [
    ("ppo", ["--pretrain", "x", "--foo_bar", "3"], "unknown OpenRLHF flag --foo_bar"),
    ("ppo", ["--pretrian", "x"], "unknown OpenRLHF flag --pretrian; did you mean --pretrain?"),
    ("ppo", ["--pretrain", "x", "--beta", "0.1"], "--beta is a flag of OpenRLHF's train_dpo, not of train_ppo_ray"),
    ("ppo", ["--normalize_reward"], "--normalize_reward: the reward statistics OpenRLHF stores"),
    ("ppo", ["--num_episodes", "2"], "--num_episodes: hpc_rlhf counts RL steps"),
    ("ppo", ["--remote_rm_url", "http://rm:5000/get_reward"], "--remote_rm_url: OpenRLHF's remote reward protocol"),
    ("ppo", ["--lora_rank", "8"], "--lora_rank"),  # OpenRLHF's default target modules (all-linear) are refused
    ("ppo", ["--max_len", "2048"], "--max_len without --max_new_tokens"),
    ("ppo", ["--colocate_actor_ref", "--actor_num_gpus_per_node", "4"], "colocated roles need as many GPUs each"),
    ("ppo", ["--zero_stage", "two"], "--zero_stage two: not a int"),
    ("ppo", ["--adam_betas", "0.9"], "--adam_betas takes 2 values, got 1"),
    ("ppo", ["--seed", "1", "--train.seed", "2"], "--train.seed is given twice (also as --seed)"),
    ("dpo", ["--ipo"], "--ipo: hpc_rlhf's IPO"),
    ("sft", ["--max_epochs", "3"], "--max_epochs: hpc_rlhf counts optimizer steps"),
    ("rm", ["--ring_attn_size", "2"], "--ring_attn_size: hpc_rlhf splits rows over ranks only for the RL roles"),
    ("sft", ["--ds_tensor_parallel_size", "2"], "--ds_tensor_parallel_size: hpc_rlhf trains without tensor"),
    ("prm", ["--dist_backend", "fsdp"], "--dist_backend: the trained roles run on DeepSpeed ZeRO"),
    ("kd", ["--teacher_offload"], "--teacher_offload: the frozen teacher stays on the GPU"),
    ("ppo", ["--reward_pretrain", "/m/rm", "--ring_attn_size", "3"],
     "--ring_attn_size 3: actor_sp=3 does not divide the actor's 8 GPUs"),
    ("ppo", ["--reward_pretrain", "/m/rm", "--ring_attn_size", "0"], "--ring_attn_size 0: the ranks sharing a row"),
    ("ppo", ["--reward_pretrain", "/m/rm", "--micro_train_batch_size", "3", "--train_batch_size", "64"],
     "must be a multiple of"),
    ("ppo", ["--pretrain", "/m"], "no reward: set reward.models"),  # OpenRLHF needs a reward model or function
])
def test_what_cannot_be_converted_exactly_is_refused_by_name(tmp_path, capsys, mode, flags, message):
    code, _, err = converted(tmp_path, capsys, mode, flags)
    assert code == 2
    assert err.startswith("hpc-rlhf from-openrlhf: ") and message in err and err.count("\n") == 1, err


def test_a_refusal_is_lifted_by_the_key_given_with_set(tmp_path, capsys):
    code, cfg, err = converted(tmp_path, capsys, "ppo", ["--reward_pretrain", "/m/rm", "--num_episodes", "2",
                                                         "--lr_warmup_ratio", "0.03", "--micro_train_batch_size", "1"],
                               ["train.max_steps=40", "train.warmup_steps=2"])
    assert code == 0, err
    assert (cfg.train.max_steps, cfg.train.warmup_steps) == (40, 2)


def test_the_flag_tables_list_every_flag_of_each_script():
    for mode in MODES:
        table = flag_table(mode)
        for flag in FLAGS:
            if mode in flag.modes:
                assert f"| `{flag.name}`" in table, (mode, flag.name)
        assert len(table.splitlines()) - 2 == len([f for f in FLAGS if mode in f.modes])
    assert set(flags_of("ppo")) >= {"--actor_num_gpus_per_node", "--actor.num_gpus_per_node", "--zero_stage",
                                    "--ds.zero_stage", "--vllm_num_engines", "--colocate_all_models"}


def test_the_printed_yaml_names_the_ignored_flags_and_the_defaults_it_keeps(tmp_path, capsys):
    assert main(["from-openrlhf", "--", "--pretrain", "/m", "--reward_pretrain", "/m/rm", "--local_rank", "0",
                 "--micro_rollout_batch_size", "4", "--micro_train_batch_size", "1"]) == 0
    out = capsys.readouterr().out
    assert "# ignored --local_rank: set by the deepspeed launcher" in out
    assert "#   --init_kl_coef               rl.kl_coef=0.02" in out
    assert yaml.safe_load(out)["actor"]["path"] == "/m"


def test_dynamic_batches_become_micro_batches_by_tokens_with_openrlhfs_defaults(tmp_path, capsys):
    """--use_dynamic_batch: training's micro-batches of --train_max_tokens_per_gpu tokens (OpenRLHF's default 16192),
    scoring's of --rollout_max_tokens_per_gpu (default: the training one); without it the budgets are inert, as
    in OpenRLHF."""
    base = ["--pretrain", "/m/sft", "--reward_pretrain", "/m/rm", "--micro_train_batch_size", "1",
            "--train_batch_size", "64"]
    for flags, train_tokens, score_tokens in (
            (["--use_dynamic_batch"], 16192, 16192),
            (["--use_dynamic_batch", "--train_max_tokens_per_gpu", "4096"], 4096, 4096),
            (["--use_dynamic_batch", "--train_max_tokens_per_gpu", "4096", "--rollout_max_tokens_per_gpu", "8192"],
             4096, 8192),
            (["--train_max_tokens_per_gpu", "4096"], 0, 0)):
        code, cfg, err = converted(tmp_path, capsys, "ppo", base + flags, ["train.max_steps=10"])
        assert code == 0, err
        assert (cfg.rl.micro_batch_tokens, cfg.rl.score_micro_batch_tokens) == (train_tokens, score_tokens), flags
    code, _, err = converted(tmp_path, capsys, "ppo", base + ["--use_dynamic_batch", "--train_max_tokens_per_gpu",
                                                              "0"], ["train.max_steps=10"])
    assert code == 2 and "--train_max_tokens_per_gpu 0: a micro-batch holds at least one token" in err, err


def test_ring_attention_becomes_sequence_blocks_of_every_trained_and_scoring_role(tmp_path, capsys):
    """OpenRLHF's --ring_attn_size K (ring attention in every model, on packed samples) is K ranks of each of actor,
    critic, ref and reward sharing a packed row; --ring_head_stride has no meaning for heads sent by all-to-all and
    is listed as ignored with the reason."""
    flags = ["--pretrain", "/m/sft", "--reward_pretrain", "/m/rm", "--ref_num_gpus_per_node", "4",
             "--reward_num_gpus_per_node", "4", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "4",
             "--ring_attn_size", "4", "--ring_head_stride", "2", "--packing_samples",
             "--micro_train_batch_size", "1", "--train_batch_size", "64", "--rollout_batch_size", "16",
             "--n_samples_per_prompt", "4"]
    code = main(["from-openrlhf", "--mode", "ppo", "--set", "train.max_steps=10", "--", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "# ignored --ring_head_stride: the ranks sharing a row exchange whole attention heads by all-to-all" in out
    code, cfg, err = converted(tmp_path, capsys, "ppo", flags, ["train.max_steps=10"])
    assert code == 0, err
    assert cfg.placement == ("actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4,actor_sp=4,critic_sp=4,ref_sp=4,"
                             "reward_sp=4")
    assert cfg.rl.padding_free is True
    # without --packing_samples the packed rows that sequence blocks split are switched on all the same
    code, cfg, err = converted(tmp_path, capsys, "ppo", [f for f in flags if f != "--packing_samples"],
                               ["train.max_steps=10"])
    assert code == 0 and cfg.rl.padding_free is True, err
    # a value of 1 is the default: no _sp key
    ones = [f if f != "4" or flags[i - 1] != "--ring_attn_size" else "1" for i, f in enumerate(flags)]
    code, cfg, err = converted(tmp_path, capsys, "ppo", ones, ["train.max_steps=10"])
    assert code == 0 and "_sp" not in cfg.placement, err


@pytest.mark.parametrize("mode", MODES)
def test_a_converted_config_reads_no_built_in_tiny_file(tmp_path, capsys, mode):
    """Without --eval_dataset OpenRLHF evaluates nothing; the converted config must not fall back on hpc_rlhf's
    defaults, the built-in tiny task's held-out files (it did: a 7B reward model evaluated on tiny additions)."""
    data = ["--prompt_data", "/d/prompts.jsonl", "--reward_pretrain", "/m/rm", "--micro_train_batch_size", "1",
            "--train_batch_size", "256", "--rollout_batch_size", "256"] if mode == "ppo" else \
        ["--dataset", "/d/rows.jsonl"]
    code, cfg, err = converted(tmp_path, capsys, mode, ["--pretrain", "/m/sft", *data])
    assert code == 0, err
    assert cfg.data.eval_files == []
    if hasattr(cfg, "eval") and hasattr(cfg.eval, "prompt_files"):
        assert cfg.eval.prompt_files == []
    code, cfg, err = converted(tmp_path, capsys, mode, ["--pretrain", "/m/sft", *data, "--eval_dataset", "/d/e.jsonl"])
    assert code == 0, err
    assert cfg.data.eval_files == ["/d/e.jsonl"]
