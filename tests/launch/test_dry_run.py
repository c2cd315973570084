"""`hpc-rlhf MODE --config FILE --dry-run --world-size N --gpus-per-node G [--model PRESET]`: every example config
of the cluster scripts starts on its script's allocation; a config that contradicts the layout is refused with
exit code 2 and one line naming the key; the memory figures are those of `hpc-rlhf plan` (one check for both)."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.cli import main
from hpc_rlhf.config import TINY_ASSETS, load_config
from hpc_rlhf.dist.allocation import AllocationError
from hpc_rlhf.dist.memory import ModelShape
from hpc_rlhf.launch.dry_run import check_config, check_stop_lead
from hpc_rlhf.launch.modes import TRAINING_MODES, mode_config
from hpc_rlhf.rl import ppo
from tests.distributed import worker_env
from tests.launch.test_sbatch_scripts import GPU_SCRIPTS, default_of, directives

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "cluster"


def allocation_of(script: Path) -> tuple[str, str, int, int, str]:
    """(mode, config, world size, ranks per node, preset) as the script gives them to its check."""
    found = directives(script)
    text = script.read_text()
    mode = re.search(r"^MODE=\$\{MODE:-(\w+)\}", text, re.MULTILINE).group(1)
    per_node = int(found["ntasks-per-node"])
    return (mode, default_of(script, "CONFIG"), int(found["nodes"]) * per_node, per_node,
            default_of(script, "PLAN_MODEL"))


def dry_run(capsys, mode, config, world, per_node, *extra):
    code = main([mode, "--config", str(REPO / config), "--dry-run", "--world-size", str(world),
                 "--gpus-per-node", str(per_node), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_gpu_script_has_its_example_config():
    configs = {allocation_of(script)[1] for script in GPU_SCRIPTS}
    assert configs == {f"examples/cluster/{p.name}" for p in EXAMPLES.glob("*.yaml")}
    assert allocation_of(REPO / "sbatch" / "ppo_70b.sbatch")[1] == "examples/cluster/ppo_70b.yaml"


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_each_example_config_passes_the_dry_run_for_its_scripts_allocation(capsys, script):
    mode, config, world, per_node, preset = allocation_of(script)
    placement = default_of(script, "PLACEMENT")
    extra = [f"placement={placement}"] if placement else [f"dist.nproc={world}"]  # what sbatch/common.sh passes
    code, out, err = dry_run(capsys, mode, config, world, per_node, "--model", preset, *extra,
                             "--stop-lead-s", default_of(script, "STOP_LEAD_S"),
                             "--requeue-margin-s", default_of(script, "REQUEUE_MARGIN_S") or "120")
    assert code == 0 and err == "", err  # the script's stop signal leaves time for its checkpoint: no warning
    assert "the plan fits\nstop: a checkpoint of up to" in out and "note: sized by --model" in out
    assert f"{world} ranks on {world // per_node} node(s)" in out
    assert f"--signal=USR1@{default_of(script, 'STOP_LEAD_S')}" in script.read_text()
    # The config carries what the layout needs: the placement it names is the script's, and placeholders are marked.
    text = (REPO / config).read_text()
    assert "PLACEHOLDER" in text and "/path/to/" in text
    if placement:
        assert f"placement: {placement}" in text


def test_ppo_70b_carries_vllm_adam_offload_and_zero_3():
    cfg = load_config(ppo.Config, EXAMPLES / "ppo_70b.yaml")
    assert cfg.rollout.backend == "vllm" and cfg.train.adam_offload and cfg.critic_train.adam_offload
    assert cfg.train.zero_stage == cfg.critic_train.zero_stage == 3 and cfg.checkpoint.every_steps > 0


PPO_70B = ("ppo", "examples/cluster/ppo_70b.yaml", 32, 8, "--model", "70b")


@pytest.mark.parametrize("override,key", [
    (["train.adam_offload=false"], "train.adam_offload"),  # ~286 GB per actor rank
    (["rollout.backend=hf"], "placement"),  # the hf engine does no tensor parallelism (names rollout.backend too)
    (["rollout.gpu_memory_utilization=0.4"], "rollout.gpu_memory_utilization"),
    (["ranks_per_node=4"], "ranks_per_node"),
    (["placement=actor=4,critic=4,ref=4,reward=4,rollout=8,rollout_tp=4"], "placement"),  # 24 ranks, not 32
    (["placement=actor=4,ref=4,reward=4,rollout=20,rollout_tp=4"], "placement"),  # gae needs a critic
    (["train.batch_size=60"], "train.batch_size"),
    (["train.adam_offload=true", "train.zero_stage=0"], "train.adam_offload"),
])
def test_a_config_that_contradicts_the_layout_is_refused_in_one_line_naming_the_key(capsys, override, key):
    code, out, err = dry_run(capsys, *PPO_70B, *override)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(rf"--dry-run: (command line: )?{re.escape(key)}\b", err), err


def test_ppo_70b_needs_nodes_of_about_1_1_tb_for_its_offloaded_adam_states(capsys):
    """A DGX H100 node (2 TB) holds the actor's or the critic's offloaded Adam states; 512 GB is refused in one
    line naming the offload; without --host-memory-gb nothing is checked and the report still shows the sums."""
    code, out, err = dry_run(capsys, *PPO_70B, "--host-memory-gb", "2048")
    assert code == 0 and "the plan fits" in out and "node memory 2048 GB" in out, err
    code, out, err = dry_run(capsys, *PPO_70B, "--host-memory-gb", "512")
    assert code == 2 and len(err.splitlines()) == 1 and "the plan does NOT fit: host memory" in out
    assert re.search(r"--dry-run: train\.adam_offload: node 0 needs 11\d\d GB of host memory, more than 512 GB", err)
    code, out, err = dry_run(capsys, *PPO_70B)
    assert code == 0 and "node 0 1,1" in out and "not checked" in out


def test_the_stop_lead_is_checked_against_the_checkpoint_each_node_writes(capsys):
    """ppo_70b's actor node writes its 8 ranks' weight shards and offloaded Adam states (~986 GB): at 2 GB/s that
    takes longer than the 480 s a 600 s lead leaves before the requeue guard (120 s): a warning, not a refusal;
    the script's 1,500 s is enough; a margin as long as the lead is refused."""
    report = check_config("ppo", load_config(ppo.Config, EXAMPLES / "ppo_70b.yaml"), 32, 8, "70b")
    actor, critic = report["roles"]["actor"]["breakdown_gb"], report["roles"]["critic"]["breakdown_gb"]
    stop = check_stop_lead(report, lead_s=600, margin_s=120, gbps=2.0)
    assert stop["gb_per_node"][0] == pytest.approx(8 * (actor["weights"] + actor["cpu_optimizer"]), abs=0.1)
    assert stop["gb_per_node"][1] == pytest.approx(8 * (critic["weights"] + critic["cpu_optimizer"]), abs=0.1)
    assert stop["gb_per_node"][2:] == [0.0, 0.0]  # reference, reward, engines: nothing to save
    assert stop["write_s"] == pytest.approx(max(stop["gb_per_node"]) / 2.0, abs=0.1) and not stop["enough"]
    assert check_stop_lead(report, lead_s=1500, margin_s=120, gbps=2.0)["enough"]
    assert not check_stop_lead(report, lead_s=1500, margin_s=120, gbps=2.0, step_s=1000)["enough"]
    code, out, err = dry_run(capsys, *PPO_70B, "--stop-lead-s", "600")
    assert code == 0 and "the plan fits" in out
    assert re.search(r"warning: the stop signal's lead is too short for a checkpoint of up to 98\d GB per node at "
                     r"2 GB/s: 49\d s.*lead of at least 61\d s plus one step", err), err
    code, out, err = dry_run(capsys, *PPO_70B, "--stop-lead-s", "100")
    assert code == 2 and re.fullmatch(r"hpc-rlhf ppo --dry-run: --requeue-margin-s: 120 s must be .*\n", err), err


def test_an_engine_across_two_nodes_is_refused(capsys):
    code, out, err = dry_run(capsys, "ppo", "examples/cluster/ppo_70b.yaml", 30, 6, "--model", "70b",
                             "placement=actor=2,critic=1,ref=1,reward=2,rollout=24,rollout_tp=4")
    assert code == 2 and len(err.splitlines()) == 1
    assert "--dry-run: placement: 'rollout' (24 ranks) cannot be cut into rollout engines" in err
    assert "plan so far:" in out


def test_one_model_modes_check_the_world_and_the_batch_size(capsys):
    sft = ("sft", "examples/cluster/sft.yaml", 16, 8, "--model", "7b")
    code, _, err = dry_run(capsys, *sft)  # no dist.nproc=16: the ranks would not make a world of 16
    assert code == 2 and "dist.nproc: is 1 but the allocation has 16 ranks" in err
    code, _, err = dry_run(capsys, *sft, "dist.nproc=16", "train.batch_size=96")
    assert code == 2 and err.startswith("hpc-rlhf sft --dry-run: train.batch_size: 96 must be a multiple")


def test_placeholder_model_folders_need_a_shape(capsys, tmp_path):
    code, _, err = dry_run(capsys, "dpo", "examples/cluster/dpo.yaml", 8, 8, "dist.nproc=8")
    assert code == 2 and "--dry-run: model.path: '/path/to/models/llama-2-7b-sft' is not a model folder" in err
    # A folder with a config.json gives its own shape, --model or not.
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100,
                                                      "num_attention_heads": 4, "intermediate_size": 128}))
    code, out, err = dry_run(capsys, "dpo", "examples/cluster/dpo.yaml", 8, 8, "--model", "70b", "dist.nproc=8",
                             f"model.path={tmp_path}", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["params"] < 10**6


def test_dry_run_flags_need_dry_run_and_an_allocation(capsys):
    assert main(["sft", "--world-size", "8"]) == 2
    assert "--world-size is a flag of the dry run" in capsys.readouterr().err
    assert main(["sft", "--dry-run", "--gpus-per-node", "8"]) == 2
    assert "--world-size is needed" in capsys.readouterr().err


def test_the_dry_run_and_hpc_rlhf_plan_compute_the_same_plan(capsys):
    """One check for both: the dry run of a config and `hpc-rlhf plan` with the flags that say the same."""
    code, out, _ = dry_run(capsys, *PPO_70B, "--json", "critic_train.adam_offload=true", "data.max_len=2048",
                           "rollout.prompts_per_step=64", "rollout.n_samples=4", "rollout.gpu_memory_utilization=1.0",
                           "rollout.weight_sync_bucket_mb=1")  # the plan has no weight-sync buffers: 2 MiB here
    assert code == 0
    from_config = json.loads(out)
    assert main(["plan", "--world-size", "32", "--gpus-per-node", "8", "--model", "70b", "--adam-offload",
                 "--placement", "actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4", "--seq-len", "2048",
                 "--rollout-seqs", "128", "--json"]) == 0
    from_flags = json.loads(capsys.readouterr().out)
    for name in from_flags["roles"]:
        assert from_config["roles"][name]["breakdown_gb"] == pytest.approx(from_flags["roles"][name]["breakdown_gb"],
                                                                           abs=0.003), name
        assert from_config["roles"][name]["ranks"] == from_flags["roles"][name]["ranks"]


def test_the_dry_run_sizes_passes_by_the_token_budgets_and_the_plan_flag_says_the_same(capsys):
    """rl.micro_batch_tokens cuts the training roles' passes, rl.score_micro_batch_tokens the scoring roles'
    (falling back to the first): the memory figures follow, as `hpc-rlhf plan --micro-batch-tokens` computes them."""
    def activations(*settings: str) -> dict[str, float]:
        roles = json.loads(dry_run(capsys, *PPO_70B, "--json", "data.max_len=2048", "rollout.weight_sync_bucket_mb=1",
                                   *settings)[1])["roles"]  # the plan has no weight-sync buffers: 2 MiB here
        return {name: row["breakdown_gb"]["activations"] for name, row in roles.items()}

    def samples(count: int) -> dict[str, float]:
        return activations(f"train.micro_batch_size={count}", f"critic_train.micro_batch_size={count}")

    budgets = activations("train.micro_batch_size=8", "critic_train.micro_batch_size=8", "rl.micro_batch_tokens=4096",
                          "rl.score_micro_batch_tokens=2048")
    two, one, eight = samples(2), samples(1), samples(8)
    assert eight["actor"] > 2 * two["actor"]  # the sample count matters without a budget
    for name in ("actor", "critic"):  # 4096 tokens: two samples of 2048
        assert budgets[name] == pytest.approx(two[name], abs=1e-6), name
    for name in ("ref", "reward"):  # 2048 tokens: one sample
        assert budgets[name] == pytest.approx(one[name], abs=1e-6), name
    assert budgets["rollout"] == eight["rollout"]
    assert main(["plan", "--world-size", "32", "--gpus-per-node", "8", "--model", "70b", "--adam-offload",
                 "--placement", "actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4", "--seq-len", "2048",
                 "--micro-batch-size", "8", "--micro-batch-tokens", "4096", "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)["roles"]
    assert flags["actor"]["breakdown_gb"]["activations"] == pytest.approx(budgets["actor"], abs=0.003)
    assert main(["plan", "--world-size", "8", "--gpus-per-node", "8", "--model", "7b", "--placement", "actor=8",
                 "--micro-batch-tokens", "-1"]) == 2
    assert "--micro-batch-tokens: must be at least 0" in capsys.readouterr().err


def test_check_config_is_a_function_other_commands_call():
    cfg = load_config(ppo.Config, EXAMPLES / "ppo_70b.yaml")
    report = check_config("ppo", cfg, 32, 8, model="70b")
    assert report["fits"] and report["roles"]["rollout"]["engines"][0] == [24, 25, 26, 27]
    assert report["stand_in_shapes"]["actor.path"] == "/path/to/models/llama-2-70b-sft"
    with pytest.raises(AllocationError) as refused:
        check_config("ppo", cfg, 16, 8, model="70b")
    assert refused.value.key == "placement" and "asks for 32 ranks" in str(refused.value)


# --------------------------------------------------------------------------------- sequence parallel (issue 40)
PPO_70B_32K = ("ppo", "examples/long_context/ppo_70b_32k.yaml", 32, 8, "--model", "70b")
SP_32K = "actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=8,actor_sp=4,critic_sp=4,ref_sp=2,reward_sp=2"


def test_the_32k_token_70b_example_fits_ppo_70bs_allocation_with_its_roles_split_into_sequence_blocks(capsys):
    """The flagship allocation (sbatch/ppo_70b.sbatch: 4 nodes x 8 GPUs of 80 GB) holds 70B PPO on 32k-token samples
    once the trained and scoring roles share their rows over sequence blocks; the same config with the actor's
    rows whole (actor_sp=1) is refused in one line that names actor_sp."""
    assert default_of(REPO / "sbatch" / "ppo_70b.sbatch", "STOP_LEAD_S")  # the script the example is run with
    cfg = load_config(ppo.Config, REPO / PPO_70B_32K[1])
    assert cfg.placement == SP_32K and cfg.data.max_len == 32768
    code, out, err = dry_run(capsys, *PPO_70B_32K, "--stop-lead-s", "1500")
    assert code == 0 and err == "", err
    assert "the plan fits" in out
    assert re.search(r"^actor .*role\(8\), 2 x sequence\(4\)", out, re.MULTILINE), out
    assert re.search(r"^ref .*role\(4\), 2 x sequence\(2\)", out, re.MULTILINE), out
    report = check_config("ppo", cfg, 32, 8, "70b")
    assert {n: r["sequence_parallel"] for n, r in report["roles"].items()} == {
        "actor": 4, "critic": 4, "ref": 2, "reward": 2, "rollout": 1}
    whole = SP_32K.replace(",actor_sp=4", "")
    code, out, err = dry_run(capsys, *PPO_70B_32K, f"placement={whole}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(r"--dry-run: placement: role 'actor' needs 10\d\.\d GB per GPU, more than 80 GB; try "
                     r"actor_sp=\d in placement \(activations take 6\d\.\d GB per GPU at actor_sp=1", err), err


def test_a_sequence_block_that_does_not_divide_the_models_heads_is_refused_naming_the_key_and_folder(capsys, tmp_path):
    six = ModelShape(hidden=1536, layers=4, heads=6, kv_heads=2, intermediate=4096, vocab=32000)
    (tmp_path / "config.json").write_text(json.dumps(six.to_config_json()))
    code, out, err = dry_run(capsys, "ppo", "examples/long_context/ppo_70b_32k.yaml", 32, 8,
                             "--model", str(tmp_path / "config.json"))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("--dry-run: placement: actor_sp=4 does not divide the 6 attention heads of actor's model (2 key/value "
            "heads), actor.path=/path/to/models/llama-2-70b-sft (sized by --model)") in err, err
    # a real folder is named as such; a K that divides the query heads but not the key/value heads is accepted
    # (they travel repeated: the memory model counts it)
    twelve = ModelShape(hidden=1536, layers=4, heads=12, kv_heads=2, intermediate=4096, vocab=32000)
    model = tmp_path / "critic"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(twelve.to_config_json()))
    code, out, err = dry_run(capsys, "ppo", "examples/long_context/ppo_70b_32k.yaml", 32, 8, "--model", "70b",
                             f"critic.path={model}", f"placement={SP_32K.replace('critic_sp=4', 'critic_sp=8')}")
    assert code == 2 and f"critic_sp=8 does not divide the 12 attention heads of critic's model (2 key/value " \
                         f"heads), critic.path={model}: " in err, err
    code, out, err = dry_run(capsys, "ppo", "examples/long_context/ppo_70b_32k.yaml", 32, 8, "--model", "70b",
                             f"critic.path={model}", f"placement={SP_32K}")  # critic_sp=4: 12 heads, 2 key/value heads
    assert code == 0, err


def test_each_mode_names_its_recipes_config():
    for mode, module in TRAINING_MODES.items():
        assert importlib.import_module(module).Config is mode_config(mode), mode


# Run in a fresh interpreter: what --help and the dry run import is the point (the test process has torch).
NO_TORCH_CHECK = """
import sys
from hpc_rlhf.cli import main
for mode in {modes!r}:
    assert main([mode, "--help"]) == 0, mode
codes = [main([mode, "--config", config, "--dry-run", "--world-size", str(world), "--gpus-per-node", str(world),
               "--check-files", *extra]) for mode, config, world, extra in {dry_runs!r}]
loaded = [name for name in ("torch", "transformers", "deepspeed", "datasets") if name in sys.modules]
print("CODES", codes, "LOADED", loaded)
"""


def test_help_and_the_dry_run_with_its_file_checks_import_no_torch(tmp_path):
    """What an sbatch script's check runs in the batch step (sbatch/common.sh) costs a second, not torch's
    import: the configs, the plan and the file checks need none of it."""
    from hpc_rlhf.data.assets import ensure_assets  # the tiny model folder the dry runs check

    ensure_assets(TINY_ASSETS)
    model = f"{TINY_ASSETS}/models/llama-tiny"
    dry_runs = [("sft", "examples/tiny/sft.yaml", 2, ["dist.nproc=2", f"output_dir={tmp_path / 'sft'}"]),
                ("grpo", "examples/tiny/grpo.yaml", 4, [f"actor.path={model}", f"output_dir={tmp_path / 'grpo'}"])]
    code = NO_TORCH_CHECK.format(modes=list(TRAINING_MODES), dry_runs=dry_runs)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "CODES [0, 0] LOADED []", proc.stdout[-3000:] + proc.stderr[-3000:]
