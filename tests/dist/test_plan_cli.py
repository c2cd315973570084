import json
import subprocess
import sys

import pytest

from hpc_rlhf.cli import main
from hpc_rlhf.dist.memory import ModelShape, estimate
from tests.distributed import REPO, worker_env

LAYOUT_16 = ["--world-size", "16", "--gpus-per-node", "8", "--model", "7b",
             "--placement", "actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2"]


def run_plan(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_every_role_with_ranks_groups_and_verdict(capsys):
    code, out, err = run_plan(capsys, *LAYOUT_16)
    assert code == 0 and err == ""
    rows = {}
    for line in out.splitlines():  # the first table; the memory breakdown repeats the role names below it
        if line.split():
            rows.setdefault(line.split()[0], line.split())
    assert rows["actor"][1:3] == ["0-3", "0"]
    assert rows["rollout"][1:3] == ["8-15", "1"]
    assert "4 engine(s) of 2" in out and "weight-sync(9) leader" in out
    assert rows["critic"][-1] == "yes"
    assert out.rstrip().endswith("the plan fits")
    assert "llama-2-7b (6.74B parameters); ZeRO-3" in out


def test_json_matches_the_memory_model(capsys):
    code, out, _ = run_plan(capsys, *LAYOUT_16, "--json", "--zero-stage", "2", "--overhead-gb", "1.5")
    assert code == 0
    result = json.loads(out)
    assert result["world_size"] == 16 and result["fits"] is True
    assert set(result["roles"]) == {"actor", "critic", "ref", "reward", "rollout"}
    critic = result["roles"]["critic"]
    assert critic["ranks"] == [4, 5] and critic["nodes"] == [0]
    # the critic's ranks hold 4 NCCL communicators: its role group, the batch's group and two score groups (the
    # trained ranks'; those and the ref's and the reward model's leaders)
    assert critic["communicators"] == 4 and critic["breakdown_gb"]["nccl"] == pytest.approx(4 * 0.6)
    want = estimate("critic", ModelShape.preset("7b"), 2, zero_stage=2, overhead_gb=0)["total"] + 1.5 + 4 * 0.6
    assert critic["memory_gb_per_rank"] == pytest.approx(want, abs=1e-3)
    assert result["roles"]["rollout"]["engines"] == [[8, 9], [10, 11], [12, 13], [14, 15]]


def test_colocated_roles_add_up_on_their_ranks(capsys):
    args = ["--world-size", "8", "--gpus-per-node", "8", "--model", "7b", "--json",
            "--placement", "actor+ref=4,critic=2,rollout=2"]
    result = json.loads(run_plan(capsys, *args)[1])
    actor, ref = result["roles"]["actor"], result["roles"]["ref"]
    together = actor["own_memory_gb"] + ref["own_memory_gb"] + 1.0 + actor["breakdown_gb"]["nccl"]
    assert actor["memory_gb_per_rank"] == ref["memory_gb_per_rank"] == pytest.approx(together, abs=2e-3)


def test_gpu_memory_decides_fits(capsys):
    layout_70b = ["--world-size", "32", "--gpus-per-node", "8", "--model", "70b", "--json",
                  "--placement", "actor=4,critic=4,ref=4,reward=4,rollout=16,rollout_tp=4"]
    without_offload = json.loads(run_plan(capsys, *layout_70b)[1])
    assert without_offload["fits"] is False and without_offload["roles"]["actor"]["fits"] is False
    assert without_offload["roles"]["ref"]["fits"] is True
    with_offload = json.loads(run_plan(capsys, *layout_70b, "--adam-offload")[1])
    assert with_offload["roles"]["actor"]["breakdown_gb"]["optimizer"] == 0
    assert with_offload["roles"]["actor"]["breakdown_gb"]["cpu_optimizer"] > 200
    # 77 GB of its own, 1 GB overhead and 6 communicators on the actor's leader: not on 80 GB, on 94 GB (H100 NVL)
    assert with_offload["fits"] is False and with_offload["roles"]["actor"]["communicators"] == 6
    assert json.loads(run_plan(capsys, *layout_70b, "--adam-offload", "--gpu-memory-gb", "94")[1])["fits"] is True
    tiny_gpu = json.loads(run_plan(capsys, *layout_70b, "--adam-offload", "--gpu-memory-gb", "40")[1])
    assert tiny_gpu["fits"] is False


def test_model_from_a_config_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 100}))
    code, out, _ = run_plan(capsys, "--world-size", "2", "--gpus-per-node", "2", "--model", str(tmp_path),
                            "--placement", "actor=2", "--json")
    assert code == 0
    assert json.loads(out)["model"]["params"] == ModelShape.from_config_json(tmp_path).num_params


def test_lora_rank_plans_the_adapter_and_no_reference_role(capsys):
    """A 70B LoRA actor (issue 27): the estimate of the actor follows the memory model with the adapter, the
    engines hold an adapter slot, and the report says what a weight sync moves."""
    args = ["--world-size", "16", "--gpus-per-node", "8", "--model", "70b", "--placement",
            "actor=8,rollout=8,rollout_tp=4", "--lora-rank", "8"]
    result = json.loads(run_plan(capsys, *args, "--json")[1])
    shape = ModelShape.preset("70b")
    assert result["lora"]["params"] == shape.lora_params(8) and result["lora"]["sync_gb"] < 0.1
    assert result["roles"]["actor"]["own_memory_gb"] == pytest.approx(
        estimate("actor", shape, 8, zero_stage=3, micro_batch_size=1, seq_len=2048, lora_rank=8,
                 overhead_gb=0)["total"], abs=1e-3)
    full = json.loads(run_plan(capsys, *args[:-2], "--json")[1])
    assert result["roles"]["actor"]["own_memory_gb"] < full["roles"]["actor"]["own_memory_gb"] - 100
    assert result["roles"]["rollout"]["own_memory_gb"] > full["roles"]["rollout"]["own_memory_gb"]
    out = run_plan(capsys, *args)[1]
    assert "LoRA rank 8 on q_proj, k_proj, v_proj, o_proj: 32.8M trained parameters" in out
    assert "a weight sync moves 66 MB (bf16) instead of 138.0 GB" in out


@pytest.mark.parametrize("args, message", [
    (["--lora-rank", "-1"], "--lora-rank: must be at least 0"),
    (["--lora-rank", "8", "--lora-targets", "q_proj,qkv"], "--lora-targets: ['qkv'] given"),
])
def test_bad_lora_flags_exit_2_with_a_message(capsys, args, message):
    code, out, err = run_plan(capsys, *LAYOUT_16, *args)
    assert code == 2 and out == "" and message in err


@pytest.mark.parametrize("args,message", [
    (["--world-size", "8", "--gpus-per-node", "8", "--model", "7b", "--placement", "actor=4,critic=2"],
     "--placement: the placement asks for 6 ranks"),
    (["--world-size", "8", "--gpus-per-node", "8", "--model", "9b", "--placement", "actor=8"],
     "--model: unknown model preset '9b'"),
    (["--world-size", "8", "--gpus-per-node", "8", "--model", "7b", "--placement", "actor=8",
      "--zero-stage", "0", "--adam-offload"], "Adam offload needs ZeRO stage"),
    (["--world-size", "8", "--gpus-per-node", "8", "--model", "7b"], "--placement"),
    (["--world-size", "8", "--gpus-per-node", "8", "--model", "7b", "--placement", "actor=8",
      "--rollout-seqs", "0"], "--rollout-seqs: must be at least 1"),
])
def test_invalid_input_exits_2_with_a_message(capsys, args, message):
    code, out, err = run_plan(capsys, *args)
    # One line naming the flag (argparse's own errors come after its usage); what shows why goes to stdout.
    lines = err.splitlines()
    assert code == 2 and message in lines[-1] and "the plan fits" not in out
    assert len(lines) == 1 or lines[-1].startswith("hpc-rlhf plan: error:")


def test_python_dash_m_without_torch_distributed_or_deepspeed():
    env = worker_env()
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf", "plan", *LAYOUT_16, "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["roles"]["actor"]["ranks"] == [0, 1, 2, 3]
    check = ("import sys; from hpc_rlhf.cli import main; code = main(['plan', *sys.argv[1:]]); "
             "bad = [m for m in ('torch.distributed', 'deepspeed') if m in sys.modules]; "
             "sys.exit(10 + len(bad) if bad else code)")
    proc = subprocess.run([sys.executable, "-c", check, *LAYOUT_16], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
