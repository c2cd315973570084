"""Bad input, one table: every mistake a user can make in a config, a data file, a model folder or a reward
function is refused with one message that names where it is (key, flag, file, row), never with a bare traceback.

Most cases go through `hpc_rlhf.cli.main([...])` as a user would, and expect exit code 2 and the message on
stderr. Cases that get past the configuration run on a one-rank world in this process and fail while the run
sets up (before any model is trained). Reward functions are checked by the functions the recipes call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpc_rlhf.cli import main

REPO = Path(__file__).resolve().parents[1]
QUIET = ["log.progress=false", "log.tensorboard=false", "data.eval_files=[]"]


# ================================================================================================ inputs
def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _model_folder(folder: Path, model_class: str = "AutoModelForCausalLM", max_positions: int = 64) -> Path:
    import torch
    import transformers
    from transformers import AutoConfig

    from hpc_rlhf.models.tiny import copy_tokenizer

    arch = {"AutoModelForCausalLM": "LlamaForCausalLM",
            "AutoModelForTokenClassification": "LlamaForTokenClassification"}[model_class]
    config = AutoConfig.for_model("llama", vocab_size=104, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, architectures=[arch], num_labels=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        getattr(transformers, model_class).from_config(config).save_pretrained(folder)
    copy_tokenizer(folder)
    return folder


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def _sharded_copy(source: Path, folder: Path) -> None:
    """`source` saved again as three safetensors shards and an index."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import copy_tokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    model.save_pretrained(folder, max_shard_size=shard_bytes)
    assert (folder / "model-00002-of-00003.safetensors").is_file()
    copy_tokenizer(folder)


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """A folder of bad (and a few good) inputs, built once."""
    root = tmp_path_factory.mktemp("inputs")
    good = {"prompt": "1+2=", "response": "3"}
    _model_folder(root / "model")
    _model_folder(root / "classifier", "AutoModelForTokenClassification")
    (root / "no_config").mkdir()
    from hpc_rlhf.models.tiny import copy_tokenizer

    copy_tokenizer(root / "no_config")
    shutil.copytree(root / "model", root / "no_weights")
    (root / "unfinished_run" / "checkpoints" / "step_000000002").mkdir(parents=True)  # a folder with no marker
    (root / "no_weights" / "model.safetensors").unlink()
    copy_tokenizer(root / "no_pad")
    tok_config = json.loads((root / "no_pad" / "tokenizer_config.json").read_text())
    tok_config.pop("pad_token", None)
    (root / "no_pad" / "tokenizer_config.json").write_text(json.dumps(tok_config))
    # weights cut short, as an interrupted copy or a full disk leaves them
    shutil.copytree(root / "model", root / "truncated")
    _truncate(root / "truncated" / "model.safetensors", 100)
    _sharded_copy(root / "model", root / "truncated_shard")
    _truncate(root / "truncated_shard" / "model-00002-of-00003.safetensors", 1000)
    _sharded_copy(root / "model", root / "missing_shard")
    (root / "missing_shard" / "model-00002-of-00003.safetensors").unlink()
    # tokenizers: none at all (a model folder saved without it), a truncated tokenizer.json
    shutil.copytree(root / "model", root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "no_tokenizer" / name).unlink()
    shutil.copytree(root / "model", root / "truncated_tokenizer")
    _truncate(root / "truncated_tokenizer" / "tokenizer.json", 500)
    # a reward model whose stored normalisation cannot be applied
    shutil.copytree(root / "classifier", root / "zero_reward_std")
    model_config = json.loads((root / "zero_reward_std" / "config.json").read_text())
    (root / "zero_reward_std" / "config.json").write_text(json.dumps({**model_config, "reward_mean": 0.5,
                                                                      "reward_std": 0.0}))
    # a reward model whose tokenizer maps two digits to each other's ids
    shutil.copytree(root / "classifier", root / "other_tokenizer")
    copy_tokenizer(root / "other_tokenizer")
    spec = json.loads((root / "other_tokenizer" / "tokenizer.json").read_text())
    spec["model"]["vocab"]["0"], spec["model"]["vocab"]["1"] = spec["model"]["vocab"]["1"], spec["model"]["vocab"]["0"]
    (root / "other_tokenizer" / "tokenizer.json").write_text(json.dumps(spec))
    # a process reward model whose step marker is not one token of the policy's tokenizer
    shutil.copytree(root / "model", root / "prm")
    model_config = json.loads((root / "prm" / "config.json").read_text())
    (root / "prm" / "config.json").write_text(json.dumps({**model_config, "process_reward": {
        "placeholder_token": "##", "reward_tokens": ["+", "-"]}}))
    (root / "a_file").write_text("not a folder\n")
    (root / "folder").mkdir()

    _write_rows(root / "sft.jsonl", [good, good])
    (root / "empty.jsonl").write_text("")
    _write_rows(root / "malformed.jsonl", [good, '{"prompt": "1+2=", "response": "3"'])
    _write_rows(root / "missing_key.jsonl", [{"prompt": "1+2="}])
    _write_rows(root / "wrong_type.jsonl", [{"prompt": 12, "response": "3"}])
    _write_rows(root / "blank.jsonl", [{"prompt": "1+2=", "response": "  "}])
    _write_rows(root / "not_object.jsonl", [["1+2=", "3"]])
    _write_rows(root / "pairs_bad.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "12"},
                                           {"prompt": "2+2=", "chosen": ["4"], "rejected": "14"}])
    _write_rows(root / "labelled_bad.jsonl", [{"prompt": "1+1=", "completion": "2", "label": True},
                                              {"prompt": "2+2=", "completion": "14", "label": "no"}])
    (root / "rows.txt").write_text("1+2=3\n")
    (root / "no_response.csv").write_text("prompt,answer\n1+2=,3\n")
    _write_rows(root / "chat_no_role.jsonl", [{"messages": [{"content": "hi"}, {"role": "assistant",
                                                                              "content": "yo"}]}])
    _write_rows(root / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "yo"}]}])
    _write_rows(root / "chat_robot.jsonl", [{"messages": [{"role": "robot", "content": "hi"},
                                                          {"role": "assistant", "content": "yo"}]}])

    (root / "not_yaml.yaml").write_text("train: {lr: 1e-3\n")
    (root / "bad_indent.yaml").write_text("train:\n  lr: 0.001\n   max_steps: 3\n")
    (root / "binary.yaml").write_bytes(bytes(range(256)))
    (root / "output_below_file.yaml").write_text(f"output_dir: {root}/a_file/run\n")
    (root / "list.yaml").write_text("- train.lr=1\n")
    (root / "typo.yaml").write_text("train:\n  lr: 0.001\n  max_stesp: 3\n")
    (root / "flat_section.yaml").write_text("train: 5\n")

    (root / "syntax_error.py").write_text("def score(prompts, responses, answers)\n    return []\n")
    (root / "import_error.py").write_text("import not_installed_xyz\n")
    (root / "rewards.py").write_text(
        "def too_few(p, r, a):\n    return [1.0]\n"
        "def text(p, r, a):\n    return 'good'\n"
        "def nones(p, r, a):\n    return [None] * len(r)\n"
        "def nan(p, r, a):\n    return [float('nan')] * len(r)\n"
        "def broken(p, r, a):\n    return 1 / 0\n")
    return root


@pytest.fixture(autouse=True)
def isolated(monkeypatch, d):
    """Each case runs from the repository (relative asset paths) without any launcher in its environment."""
    monkeypatch.chdir(REPO)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID", "SLURM_PROCID",
                "SLURM_NTASKS", "TORCHELASTIC_USE_AGENT_STORE", "HPC_RLHF_LOCAL_LAUNCH"):
        monkeypatch.delenv(key, raising=False)
    # One process: a mode that needs more ranks must fail before it would start them here.
    monkeypatch.setattr("hpc_rlhf.launch.local.spawn_local",
                        lambda *a, **k: pytest.fail("a bad input got as far as starting ranks"))


# ================================================================================== through the CLI
SFT = ["sft", "model.path={d}/model", "data.train_files=[{d}/sft.jsonl]", "output_dir={d}/out", "eval.prompt_files=[]",
       *QUIET]
GRPO = ["grpo", "actor.path={d}/model", "output_dir={d}/out", *QUIET]
DPO = ["dpo", "model.path={d}/model", "output_dir={d}/out", "eval.prompt_files=[]", *QUIET]
KTO = ["kto", "model.path={d}/model", "output_dir={d}/out", "eval.prompt_files=[]", *QUIET]
GENERATE = ["generate", "model.path={d}/model", "data.train_files=[{d}/sft.jsonl]", "output_dir={d}/out",
            "generate.n=1", "generate.max_new_tokens=2"]

# (id, argv, text the message must contain, environment)
CLI_CASES = [
    # ---- configuration keys, types and ranges
    ("unknown key", [*SFT, "train.lrr=1e-4"], "command line: unknown key 'train.lrr'; did you mean 'train.lr'?"),
    ("key in the wrong section", [*SFT, "lr=1e-4"], "unknown key 'lr'; did you mean 'train.lr'?"),
    ("misspelt section", [*SFT, "trian.max_steps=3"], "unknown key 'trian.max_steps'; did you mean "
                                                     "'train.max_steps'?"),
    ("text for an integer", [*SFT, "train.max_steps=abc"], "key 'train.max_steps' must be an integer, got 'abc'"),
    ("fraction for an integer", [*SFT, "train.max_steps=2.5"], "key 'train.max_steps' must be an integer, got 2.5"),
    ("text for a boolean", [*SFT, "log.tensorboard=maybe"], "key 'log.tensorboard' must be true or false"),
    ("text for a number", [*SFT, "train.lr=fast"], "key 'train.lr' must be a number, got 'fast'"),
    ("below the minimum", [*SFT, "train.lr=-1"], "key 'train.lr' must be >= 0, got -1.0"),
    ("above the maximum", [*SFT, "train.adam_beta1=1.5"], "key 'train.adam_beta1' must be <= 1, got 1.5"),
    ("not a choice", [*SFT, "train.zero_stage=5"], "key 'train.zero_stage' must be one of [0, 1, 2, 3], got 5"),
    ("not a dtype", [*SFT, "model.dtype=float8"], "key 'model.dtype' must be one of"),
    ("no ranks", [*SFT, "dist.nproc=0"], "key 'dist.nproc' must be >= 1, got 0"),
    ("prompt limit not below the length limit", [*SFT, "data.max_prompt_len=64", "data.max_len=64"],
     "data.max_prompt_len (64) must be smaller than data.max_len (64)"),
    ("override without a value", [*SFT, "train.lr"], "override 'train.lr' is not of the form key=value"),
    ("unknown flag", [*SFT, "--lr", "1"], "unknown option --lr (settings are given as key=value"),
    ("unknown mode", ["stf"], "unknown mode 'stf'; did you mean 'sft'?"),
    ("misspelt key of a mode's own section (dpo)", [*DPO, "dpo.betta=0.2"], "did you mean 'dpo.beta'"),
    ("misspelt key of a mode's own section (kto)", [*KTO, "kto.desirable=2"], "did you mean 'kto.desirable_weight'"),
    # ---- configuration files
    ("missing config file", [*SFT, "--config", "{d}/nope.yaml"], "config file '{d}/nope.yaml' does not exist"),
    ("config file not YAML", [*SFT, "--config", "{d}/not_yaml.yaml"],
     "{d}/not_yaml.yaml, line 2, column 1: not valid YAML: expected ',' or '}}', but got '<stream end>' "
     "(while parsing a flow mapping at line 1, column 8)"),
    ("config file badly indented", [*SFT, "--config", "{d}/bad_indent.yaml"],
     "{d}/bad_indent.yaml, line 3, column 13: not valid YAML: mapping values are not allowed here"),
    ("config file not text", [*SFT, "--config", "{d}/binary.yaml"],
     "{d}/binary.yaml: not a YAML text file (byte 128 is not UTF-8)"),
    ("config file not a mapping", [*SFT, "--config", "{d}/list.yaml"],
     "{d}/list.yaml: the top level must be a mapping of keys, got list"),
    ("unknown key in a config file", [*SFT, "--config", "{d}/typo.yaml"],
     "{d}/typo.yaml: unknown key 'train.max_stesp'; did you mean 'train.max_steps'?"),
    ("a value where a section belongs", [*SFT, "--config", "{d}/flat_section.yaml"],
     "{d}/flat_section.yaml: section 'train' must be a mapping, got 5"),
    # ---- output folders and files (found when the configuration is loaded)
    ("output folder that is a file", [*SFT, "output_dir={d}/a_file"],
     "command line: output_dir='{d}/a_file' is a file, not a folder"),
    ("output folder below a file", [*SFT, "output_dir={d}/a_file/run"],
     "command line: output_dir='{d}/a_file/run' cannot be created: '{d}/a_file' is a file, not a folder"),
    ("output folder that cannot be made (where nothing can be created)", [*SFT, "output_dir=/proc/hpc_rlhf_out"],
     "hpc-rlhf sft: output_dir: '/proc/hpc_rlhf_out' cannot be created or written: No such file or directory"),
    ("output folder below a file (config file)", ["sft", "--config", "{d}/output_below_file.yaml"],
     "{d}/output_below_file.yaml: output_dir='{d}/a_file/run' cannot be created: '{d}/a_file' is a file"),
    ("generated file below a file", [*GENERATE, "generate.output_file={d}/a_file/out.jsonl"],
     "command line: generate.output_file='{d}/a_file/out.jsonl' cannot be created: '{d}/a_file' is a file"),
    ("generated file that is a folder", [*GENERATE, "generate.output_file={d}/folder"],
     "command line: generate.output_file='{d}/folder' is a folder; give the path of a file"),
    # ---- batch sizes and placements (RL modes: all before any rank starts)
    ("batch does not divide the micro-batches", [*SFT, "train.micro_batch_size=5"],
     "train.batch_size=32 must be a multiple of train.micro_batch_size (5) x ranks of the role (1) = 5"),
    ("batch does not divide the samples of a step", [*GRPO, "train.batch_size=48"],
     "train.batch_size=48 must divide the samples of a step (rollout.prompts_per_step x rollout.n_samples = 64)"),
    ("batch does not divide across the role's ranks", [*GRPO, "placement=actor=2,ref=1,rollout=1",
                                                       "train.micro_batch_size=64"],
     "train.batch_size=64 must be a multiple of train.micro_batch_size (64) x ranks of the role 'actor' (2) = 128"),
    ("group baseline with one sample", [*GRPO, "rollout.n_samples=1", "rollout.prompts_per_step=64"],
     "rl.advantage=grpo compares samples of one prompt: rollout.n_samples must be at least 2"),
    ("misspelt role", [*GRPO, "placement=actor=1,ref=1,rolout=2"],
     "placement 'actor=1,ref=1,rolout=2': unknown role 'rolout'; did you mean 'rollout'?"),
    ("role without ranks", [*GRPO, "placement=actor=1,ref=0,rollout=2"], "'ref=0': the count must be at least 1"),
    ("placement lacks a role the config needs", [*GRPO, "placement=actor=1,rollout=2"],
     "placement 'actor=1,rollout=2': the placement has no 'ref' role, which this config needs"),
    ("placement lacks the critic of GAE", ["ppo", "placement=actor=1,ref=1,reward=1,rollout=2", *QUIET],
     "the placement has no 'critic' role, which this config needs"),
    ("tensor parallelism the backend cannot do", [*GRPO, "placement=actor=1,ref=1,rollout=2,rollout_tp=2"],
     "the hf rollout backend does no tensor parallelism"),
    ("LoRA rank larger than the vllm engine allows", [*GRPO, "placement=actor=1,rollout=1", "rollout.backend=vllm",
                                                      "actor.lora.rank=1024"],
     "actor.lora.rank=1024 is larger than the vllm rollout engine allows (LoRA rank at most 512 in vLLM 0.32)"),
    ("reference folder contradicting the LoRA actor's base", [*GRPO, "placement=actor=1,rollout=1",
                                                              "actor.lora.rank=8", "ref_mode=adapter_disabled",
                                                              "ref_path={d}/classifier"],
     "ref_path='{d}/classifier' contradicts ref_mode=adapter_disabled, whose reference is the actor's own base model "
     "(actor.path='{d}/model')"),
    ("ref role beside a LoRA actor's own reference", [*GRPO, "actor.lora.rank=8"],
     "with a LoRA actor (ref_mode=auto: adapter_disabled) the reference is the actor with its adapter off"),
    ("reward weights of the wrong length", [*GRPO, "reward.function_weights=[1.0,2.0]"],
     "reward.function_weights has 2 entries for 1 reward.functions"),
    ("no reward at all", [*GRPO, "reward.functions=[]"],
     "no reward: set reward.models, reward.functions, reward.http_url, an environment (env.name, env.http_url), or a "
     "teacher to distill from (distill.teacher)"),
    ("world smaller than the placement (torchrun)", GRPO,
     "placement needs 4 ranks but the job has 2 (launched by torchrun)",
     {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}),
    ("world smaller than the placement (srun)", GRPO,
     "placement needs 4 ranks but the job has 3 (launched by slurm)",
     {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
      "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "42"}),
    ("inconsistent launch variables", SFT, "WORLD_SIZE='2' is set but RANK is not", {"WORLD_SIZE": "2"}),
    # ---- data files (found while the run sets up, before the model is built)
    ("missing data file", [*SFT, "data.train_files=[{d}/nope.jsonl]"],
     "data.train_files: file '{d}/nope.jsonl' does not exist"),
    ("empty data file", [*SFT, "data.train_files=[{d}/empty.jsonl]"],
     "data.train_files: file '{d}/empty.jsonl' is empty"),
    ("malformed row", [*SFT, "data.train_files=[{d}/malformed.jsonl]"], "{d}/malformed.jsonl, line 2: malformed JSON"),
    ("row without a required key", [*SFT, "data.train_files=[{d}/missing_key.jsonl]"],
     "{d}/missing_key.jsonl, line 1: key 'response' is missing (the row has keys: prompt)"),
    ("value of the wrong type", [*SFT, "data.train_files=[{d}/wrong_type.jsonl]"],
     "{d}/wrong_type.jsonl, line 1: key 'prompt' must be str, got int"),
    ("blank text", [*SFT, "data.train_files=[{d}/blank.jsonl]"], "{d}/blank.jsonl, line 1: key 'response' is empty"),
    ("row that is not an object", [*SFT, "data.train_files=[{d}/not_object.jsonl]"],
     "{d}/not_object.jsonl, line 1: a row must be a JSON object with keys, got list"),
    ("unknown file format", [*SFT, "data.train_files=[{d}/rows.txt]"], "'{d}/rows.txt' has an unknown format"),
    ("table without a required column", [*SFT, "data.train_files=[{d}/no_response.csv]"],
     "{d}/no_response.csv, row 1: key 'response' is missing (the row has keys: prompt, answer)"),
    ("key name the data does not use", [*SFT, "data.prompt_key=question"],
     "{d}/sft.jsonl, line 1: key 'question' is missing"),
    ("preference pair of the wrong type (dpo)", [*DPO, "data.train_files=[{d}/pairs_bad.jsonl]"],
     "{d}/pairs_bad.jsonl, line 2: key 'chosen' must be str, got list"),
    ("label of the wrong type (kto)", [*KTO, "data.train_files=[{d}/labelled_bad.jsonl]"],
     "{d}/labelled_bad.jsonl, line 2: key 'label' must be bool or int, got str"),
    ("bad row in the held-out data", [*SFT, "data.eval_files=[{d}/wrong_type.jsonl]"],
     "{d}/wrong_type.jsonl, line 1: key 'prompt' must be str, got int"),
    ("chat message without a role", [*SFT, "data.train_files=[{d}/chat_no_role.jsonl]",
                                     "data.apply_chat_template=true"],
     "{d}/chat_no_role.jsonl, line 1: key 'messages' item 0 lacks role"),
    ("chat without the chat template", [*SFT, "data.train_files=[{d}/chat.jsonl]"],
     "{d}/chat.jsonl, line 1: a list of messages needs the chat template (data.apply_chat_template=true)"),
    ("role the chat template refuses", [*SFT, "data.train_files=[{d}/chat_robot.jsonl]",
                                        "data.apply_chat_template=true"],
     "{d}/chat_robot.jsonl, line 1: the chat template of tokenizer"),
    ("sequences longer than the model's positions", [*SFT, "data.max_len=128"],
     "data.max_len=128 is longer than the 64 positions of the model in '{d}/model'"),
    # ---- model folders
    ("missing model folder", [*SFT, "model.path={d}/nope"], "model folder '{d}/nope' does not exist"),
    ("model folder without config.json", [*SFT, "model.path={d}/no_config"],
     "model folder '{d}/no_config' has no config.json"),
    ("model folder without weights", [*SFT, "model.path={d}/no_weights"],
     "model folder '{d}/no_weights' has a config.json but no weights"),
    ("architecture the mode cannot use", [*SFT, "model.path={d}/classifier"],
     "model folder '{d}/classifier' holds a LlamaForTokenClassification, which is not a causal language model"),
    ("tokenizer without a pad token", [*SFT, "model.tokenizer={d}/no_pad"],
     "tokenizer in '{d}/no_pad' has no pad token"),
    ("missing tokenizer folder", [*SFT, "model.tokenizer={d}/nope"], "tokenizer folder '{d}/nope' does not exist"),
    ("tokenizer path that is a file", [*SFT, "model.tokenizer={d}/a_file"],
     "tokenizer path '{d}/a_file' is a file, not a folder"),
    ("model folder without a tokenizer", [*SFT, "model.path={d}/no_tokenizer"],
     "tokenizer folder '{d}/no_tokenizer' has no tokenizer files (none of tokenizer.json, tokenizer.model"),
    ("truncated tokenizer file", [*SFT, "model.path={d}/truncated_tokenizer"],
     "tokenizer folder '{d}/truncated_tokenizer': tokenizer.json is not valid JSON"),
    ("truncated weights", [*SFT, "model.path={d}/truncated"],
     "model folder '{d}/truncated': weight file model.safetensors is truncated or corrupt (100 bytes, shorter than "
     "the"),
    ("truncated weight shard", [*SFT, "model.path={d}/truncated_shard"],
     "model folder '{d}/truncated_shard': weight file model-00002-of-00003.safetensors is truncated or corrupt "
     "(1000 bytes, where its header describes"),
    ("missing weight shard", [*SFT, "model.path={d}/missing_shard"],
     "model folder '{d}/missing_shard': model.safetensors.index.json lists 1 shard file(s) that are missing: "
     "model-00002-of-00003.safetensors"),
    ("truncated reward model", [*GENERATE, "score.reward_models=[{d}/truncated]"],
     "model folder '{d}/truncated': weight file model.safetensors is truncated or corrupt"),
    ("reward model with another tokenizer", [*GENERATE, "score.reward_models=[{d}/other_tokenizer]"],
     "score.reward_models[0] '{d}/other_tokenizer' does not share the tokenizer of model.path '{d}/model': "),
    ("process reward model whose marker is two tokens", [*GENERATE, "score.reward_models=[{d}/model,{d}/prm]"],
     "score.reward_models[1] placeholder_token='##' is 2 tokens"),
    ("reward normalisation that cannot be applied", [*GENERATE, "score.reward_models=[{d}/zero_reward_std]",
                                                     "score.normalize=true"],
     "model folder '{d}/zero_reward_std': config.json has reward_std=0.0, which must be a positive finite number"),
    ("LoRA target modules the model lacks", [*GRPO, "placement=actor=1,rollout@actor", "actor.lora.rank=4",
                                             "actor.lora.target_modules=[q_proj,qkv_proj]"],
     "actor.lora.target_modules=['q_proj', 'qkv_proj']: ['qkv_proj'] matches no layer of LlamaForCausalLM; its "
     "linear layers are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ("attention kernel not installed", [*SFT, "model.attn_implementation=flash_attention_2"],
     "model.attn_implementation=flash_attention_2 needs"),
    ("checkpoints of which none verifies", [*SFT, "output_dir={d}/unfinished_run"],
     "checkpoint.resume=true: no checkpoint in {d}/unfinished_run/checkpoints verifies "
     "({d}/unfinished_run/checkpoints/step_000000002 has no COMPLETE.json (it was not finished)); move the folders "
     "away, or start over with checkpoint.resume=false"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_bad_input_with_one_clear_message(case, d, capfd, monkeypatch):
    _, argv, expected, *env = case
    for key, value in (env[0] if env else {}).items():
        monkeypatch.setenv(key, value)
    code = main([arg.format(d=d) for arg in argv])
    err = capfd.readouterr().err  # a run's error line is one write(2) to fd 2 (utils/console.py)
    assert code == 2, err[-3000:]
    assert expected.format(d=d) in err, err[-3000:]
    assert "Traceback" not in err


def test_an_error_during_the_run_stands_on_its_own_line_after_the_progress_bar(d, capfd):
    """A reward function's NaN at step 1 of a one-rank GRPO run with its progress bar on: the bar's line ends
    before the message, and no bar is drawn after it (in a Slurm output file the message once sat inside a
    `grpo:   0%|...` line)."""
    argv = ["grpo", "actor.path={d}/model", "output_dir={d}/out_bar", "placement=actor=1,rollout@actor",
            "rl.kl_coef=0", "reward.functions=[{d}/rewards.py:nan]", "rollout.prompts_per_step=2",
            "rollout.n_samples=2", "rollout.max_new_tokens=2", "train.batch_size=4", "train.micro_batch_size=4",
            "train.max_steps=2", "log.tensorboard=false", "data.eval_files=[]", "log.eval_every_steps=0"]
    assert main([arg.format(d=d) for arg in argv]) == 2
    err = capfd.readouterr().err
    message = f"rank 0: reward function '{d}/rewards.py:nan' returned nan for response 0; rewards must be finite"
    assert "\rgrpo:   0%|" in err.split(message)[0], err[-3000:]  # the bar was drawn before the failure
    assert f"\n{message}\n" in err, err[-3000:]
    assert "grpo:" not in err.split(message)[1], err[-3000:]


# ================================================================================= reward functions
def _load(spec: str):
    from hpc_rlhf.rewards import load_reward_function

    return load_reward_function(spec)


def _call(spec: str):
    from hpc_rlhf.rewards import call_reward_function

    return call_reward_function(_load(spec), spec, ["1+2=", "2+2="], ["3", "4"], ["3", "4"])


REWARD_CASES = [
    ("reward file missing", lambda d: _load(f"{d}/nope.py:score"), "file {d}/nope.py does not exist"),
    ("reward spec without a function", lambda d: _load(f"{d}/rewards.py"),
     "must look like path/to/file.py:function or package.module:function"),
    ("reward file with a syntax error", lambda d: _load(f"{d}/syntax_error.py:score"),
     "importing {d}/syntax_error.py failed: SyntaxError"),
    ("reward file importing what is not installed", lambda d: _load(f"{d}/import_error.py:score"),
     "importing {d}/import_error.py failed: ModuleNotFoundError: No module named 'not_installed_xyz'"),
    ("reward module not installed", lambda d: _load("not_installed_xyz.rewards:score"),
     "reward function 'not_installed_xyz.rewards:score': importing not_installed_xyz.rewards failed"),
    ("reward function name missing", lambda d: _load(f"{d}/rewards.py:score"),
     "{d}/rewards.py has no callable 'score'"),
    ("too few rewards", lambda d: _call(f"{d}/rewards.py:too_few"), "returned 1 rewards for 2 responses"),
    ("rewards not a list", lambda d: _call(f"{d}/rewards.py:text"), "returned str; it must return a list of 2 floats"),
    ("rewards not numbers", lambda d: _call(f"{d}/rewards.py:nones"),
     "returned None (NoneType) for response 0; rewards must be numbers"),
    ("rewards not finite", lambda d: _call(f"{d}/rewards.py:nan"),
     "returned nan for response 0; rewards must be finite"),
    ("reward function raising", lambda d: _call(f"{d}/rewards.py:broken"),
     "raised ZeroDivisionError: division by zero"),
]


@pytest.mark.parametrize("case", REWARD_CASES, ids=[c[0] for c in REWARD_CASES])
def test_reward_functions_are_refused_with_their_name(case, d):
    from hpc_rlhf.rewards import RewardFunctionError

    _, action, expected = case
    with pytest.raises(RewardFunctionError) as info:
        action(d)
    assert expected.format(d=d) in str(info.value)
    assert "reward function '" in str(info.value)

