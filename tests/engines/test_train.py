"""TrainEngine: DeepSpeed ZeRO 0-3 inside a role's process group.

In-process tests run on a one-rank gloo world. The distributed cases run under torchrun (worker code at the
bottom of this file):
  equivalence (2 ranks): ZeRO 1/2/3 (one with gradient checkpointing, one with gradient accumulation) follow the
      same loss trajectory as ZeRO-0 on a single rank with the same global batches.
  two-roles (4 ranks): ranks 0-1 train with ZeRO-3 and save a checkpoint and a Hugging Face folder while ranks 2-3
      train with ZeRO-2 for a different number of steps, all under forbid_world_collectives; the ZeRO-3 role
      then resumes from its checkpoint in a fresh engine.

Tolerance for trajectories across ZeRO stages and rank counts: everything is fp32 on the CPU, so the only
difference is the order of floating-point sums (gradients summed across ranks vs inside one batch, norms
reduced per partition, in fp64 under ZeRO-3). Those differ in the last bits of fp32 (~6e-8 relative). Measured
over 6 steps: worst relative difference 9e-8 in the losses and 2.4e-7 in the gradient norms. rtol 1e-5 leaves
a margin of 40x and more, and is still far below what a real error moves: a missed gradient reduction or a
wrong accumulation scale changes the gradient norm by tens of percent (Adam hides a pure scale error from the
losses, which is why the norms are compared too).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hpc_rlhf.config import ConfigError, TrainSection

VOCAB = 64
SEQ = 12
STEPS = 6
TRAJECTORY_RTOL = 1e-5


def tiny_model(seed: int, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


def global_batches(seed: int, steps: int, batch_size: int) -> list[torch.Tensor]:
    """Counting sequences (t, t+1, ...) from random starts: random tokens, but learnable within a few steps,
    so tests can also check that training lowers the loss."""
    generator = torch.Generator().manual_seed(seed)
    starts = [torch.randint(0, VOCAB, (batch_size, 1), generator=generator) for _ in range(steps)]
    return [(start + torch.arange(SEQ)) % VOCAB for start in starts]


def train_cfg(**overrides) -> TrainSection:
    values = dict(lr=1e-2, warmup_steps=2, max_steps=8, min_lr_ratio=0.1, micro_batch_size=4, batch_size=4,
                  weight_decay=0.1, max_grad_norm=1.0, zero_stage=0, zero3_param_persistence_threshold=0)
    values.update(overrides)
    return TrainSection(**values)


def lm_loss(engine, ids: torch.Tensor) -> torch.Tensor:
    return engine(input_ids=ids, labels=ids).loss


def run_steps(engine, batches, rank: int = 0, ranks: int = 1):
    """Train on `batches` (global batches); each rank takes its contiguous share, micro-batch by micro-batch.
    Returns per-step mean losses over the global batch (as this rank sees them: its own share) and StepInfos."""
    micro = engine.train_cfg.micro_batch_size
    losses, infos = [], []
    for batch in batches:
        share = batch.chunk(ranks)[rank]
        step_losses = []
        for start in range(0, share.shape[0], micro):
            loss = lm_loss(engine, share[start:start + micro])
            engine.backward(loss)
            info = engine.step()
            step_losses.append(loss.item())
        assert info.stepped
        losses.append(sum(step_losses) / len(step_losses))
        infos.append(info)
    return losses, infos


# ------------------------------------------------------------------------------------------ one-rank world
@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    # DeepSpeed insists on LOCAL_RANK, also in a world an earlier module made (its monkeypatch gone with it)
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="hpc_rlhf_train_store_")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist


def test_gradient_accumulation_is_derived_and_bad_batch_size_names_the_key():
    from hpc_rlhf.engines.train import deepspeed_config, gradient_accumulation_steps

    assert gradient_accumulation_steps(train_cfg(micro_batch_size=2, batch_size=16), role_size=4) == 2
    config = deepspeed_config(train_cfg(micro_batch_size=2, batch_size=16), role_size=4, dtype=torch.float32)
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (16, 2)
    assert config["checkpoint"]["tag_validation"] == "Ignore"
    with pytest.raises(ConfigError, match=r"train\.batch_size=12 .* 2 x 4 = 8"):
        gradient_accumulation_steps(train_cfg(micro_batch_size=2, batch_size=12), role_size=4)


def test_config_choices():
    from hpc_rlhf.engines.train import deepspeed_config, resolve_dtype

    with pytest.raises(ConfigError, match="train.adam_offload"):
        deepspeed_config(train_cfg(adam_offload=True, zero_stage=0), 1, torch.float32)
    offload = deepspeed_config(train_cfg(adam_offload=True, zero_stage=3), 1, torch.float32)
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    # ZeRO-0 fp32 clips in the engine itself; every other combination lets DeepSpeed clip
    assert deepspeed_config(train_cfg(zero_stage=0), 1, torch.float32)["gradient_clipping"] == 0.0
    assert deepspeed_config(train_cfg(zero_stage=2), 1, torch.float32)["gradient_clipping"] == 1.0
    assert deepspeed_config(train_cfg(zero_stage=0), 1, torch.bfloat16)["bf16"]["enabled"]
    assert resolve_dtype(None) == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    assert resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ConfigError, match="model.dtype"):
        resolve_dtype("float8")


def test_zero3_gathering_window_is_a_share_of_the_model_capped_at_deepspeeds_defaults():
    from hpc_rlhf.engines.train import deepspeed_config

    small = deepspeed_config(train_cfg(zero_stage=3), 1, torch.float32, num_params=8_000_000)["zero_optimization"]
    assert (small["stage3_max_live_parameters"], small["stage3_max_reuse_distance"],
            small["stage3_prefetch_bucket_size"], small["reduce_bucket_size"], small["sub_group_size"]) == \
        (1_000_000,) * 5
    large = deepspeed_config(train_cfg(zero_stage=3), 1, torch.float32, num_params=70 * 10**9)["zero_optimization"]
    assert (large["stage3_max_live_parameters"], large["stage3_prefetch_bucket_size"],
            large["reduce_bucket_size"]) == (10**9, 5 * 10**7, 5 * 10**8)
    assert "stage3_max_live_parameters" not in deepspeed_config(train_cfg(zero_stage=2), 1, torch.float32,
                                                                num_params=10)["zero_optimization"]


@pytest.mark.parametrize("stage", [0, 3])
def test_full_state_streams_the_state_dict(world, stage):
    """full_state() yields every state-dict entry (tied weights under both names) with the trained values; the
    dict built from it shares one tensor between tied names, as save_pretrained expects."""
    from hpc_rlhf.engines.train import TrainEngine

    engine = TrainEngine(tiny_model(0, tie=True), train_cfg(zero_stage=stage))
    run_steps(engine, global_batches(8, 2, 4))
    with engine.gathered_parameters() as module:
        expected = {name: t.detach().clone() for name, t in module.state_dict().items()}
    streamed = {name: tensor.detach().clone() for name, tensor in engine.full_state()}
    assert list(streamed) == list(expected)
    assert all(torch.equal(streamed[name], expected[name]) for name in expected)
    state = engine.full_state_dict()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]


@pytest.mark.parametrize("stage", [0, 3])
def test_adapter_state_streams_the_trained_adapter_alone(world, stage):
    """A LoRA actor's sync stream (issue 27): adapter_state() yields the adapter's tensors with their trained
    values under the names of PEFT's adapter file, one LoRA layer gathered at a time under ZeRO-3, and nothing of
    the frozen base."""
    from peft import get_peft_model_state_dict

    from hpc_rlhf.config import LoraSection
    from hpc_rlhf.engines.train import TrainEngine
    from hpc_rlhf.models.lora import apply_lora

    engine = TrainEngine(apply_lora(tiny_model(0), LoraSection(rank=4, target_modules=["q_proj", "v_proj"])),
                         train_cfg(zero_stage=stage))
    run_steps(engine, global_batches(8, 2, 4))
    streamed = {name: tensor.detach().clone() for name, tensor in engine.adapter_state()}
    with engine.gathered_parameters() as module:
        expected = get_peft_model_state_dict(module)
        assert streamed.keys() == expected.keys() and len(streamed) == 2 * 2 * 2
        assert all(torch.equal(streamed[name], expected[name]) for name in expected)
        assert any(float(t.abs().sum()) > 0 for name, t in streamed.items() if ".lora_B." in name)  # it trained


def reference_loop(model, cfg: TrainSection, batches, clip: bool) -> list[float]:
    """The textbook loop the engine must reproduce: AdamW (matrices decayed), warmup-cosine, clipping."""
    from hpc_rlhf.engines.schedule import warmup_cosine_scheduler

    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler = warmup_cosine_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_engine_matches_textbook_loop_with_clipping(world):
    from hpc_rlhf.engines.train import TrainEngine

    cfg = train_cfg(max_grad_norm=0.5)  # below the measured norms (~1.5-3): clipping acts on every step
    batches = global_batches(1, STEPS, 4)
    engine = TrainEngine(tiny_model(0), cfg)
    losses, infos = run_steps(engine, batches)
    clipped = reference_loop(tiny_model(0), cfg, batches, clip=True)
    unclipped = reference_loop(tiny_model(0), cfg, batches, clip=False)
    assert losses == pytest.approx(clipped, rel=1e-6)
    assert max(abs(a - b) for a, b in zip(losses, unclipped)) > 1e-4  # so the clipping above was exercised
    assert all(info.grad_norm > cfg.max_grad_norm and info.finite for info in infos)
    assert [info.lr for info in infos] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2 * (0.1 + 0.45 * (1 + math.cos(
        math.pi / 6)))] + [info.lr for info in infos[4:]])
    assert engine.global_step == STEPS


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_non_finite_step_is_skipped_and_reported(world, stage):
    from hpc_rlhf.engines.train import TrainEngine

    engine = TrainEngine(tiny_model(0), train_cfg(zero_stage=stage))
    good, bad, after = global_batches(2, 3, 4)
    run_steps(engine, [good])
    with engine.gathered_parameters() as module:
        before = {name: p.detach().clone() for name, p in module.named_parameters()}
    lr_before = engine.lr

    loss = lm_loss(engine, bad) * float("nan")
    engine.backward(loss)
    info = engine.step()
    assert info.stepped and not info.finite and info.skipped
    assert info.grad_norm is None or not math.isfinite(info.grad_norm)
    assert engine.skipped_steps == 1 and engine.global_step == 2
    assert engine.lr == lr_before  # the schedule did not advance either
    with engine.gathered_parameters() as module:
        for name, p in module.named_parameters():
            assert torch.equal(p, before[name]), name

    _, (info,) = run_steps(engine, [after])
    assert info.finite and math.isfinite(info.grad_norm)
    with engine.gathered_parameters() as module:
        assert any(not torch.equal(p, before[name]) for name, p in module.named_parameters())


def enable_counted_checkpointing(model) -> list[int]:
    """Turn on activation checkpointing and count the checkpointed layer calls (proof that it ran)."""
    if hasattr(model, "activation_checkpointing_enable"):  # the transformers 5.23 name; 5.19 has only the old one
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    calls = [0]
    for layer in model.model.layers:
        def counted(*args, _checkpoint=layer._gradient_checkpointing_func, **kwargs):
            calls[0] += 1
            return _checkpoint(*args, **kwargs)

        layer._gradient_checkpointing_func = counted
    return calls


def test_gradient_checkpointing_gives_the_same_trajectory(world):
    from hpc_rlhf.engines.train import TrainEngine

    batches = global_batches(3, 3, 4)
    plain, _ = run_steps(TrainEngine(tiny_model(0), train_cfg()), batches)
    model = tiny_model(0).eval()  # as from_pretrained returns it: the engine must switch to train mode
    calls = enable_counted_checkpointing(model)
    checkpointed, _ = run_steps(TrainEngine(model, train_cfg()), batches)
    assert calls[0] == 3 * 2  # steps x layers
    assert checkpointed == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("stage, micro", [(0, 4), (2, 2)])
def test_resume_from_checkpoint_continues_exactly(world, tmp_path, stage, micro):
    from hpc_rlhf.engines.train import COMPLETE_MARKER, TrainEngine

    cfg = train_cfg(zero_stage=stage, micro_batch_size=micro)  # micro 2 of batch 4: accumulation 2
    batches = global_batches(4, 5, 4)
    engine = TrainEngine(tiny_model(0), cfg)
    run_steps(engine, batches[:3])
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"data_position": 3})
    assert json.loads((tmp_path / "ckpt" / COMPLETE_MARKER).read_text())["global_step"] == 3
    uninterrupted, _ = run_steps(engine, batches[3:])

    fresh = TrainEngine(tiny_model(123), cfg)  # different initial weights: everything must come from disk
    client_state = fresh.load_checkpoint(tmp_path / "ckpt")
    assert client_state["data_position"] == 3
    assert fresh.global_step == 3 and fresh.lr == pytest.approx(cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi / 6))))
    resumed, _ = run_steps(fresh, batches[3:])
    assert resumed == uninterrupted  # exactly


def test_loading_an_incomplete_checkpoint_names_the_marker(world, tmp_path):
    from hpc_rlhf.engines.train import COMPLETE_MARKER, TrainEngine

    engine = TrainEngine(tiny_model(0), train_cfg())
    (tmp_path / "half_written").mkdir()
    with pytest.raises(FileNotFoundError, match=COMPLETE_MARKER):
        engine.load_checkpoint(tmp_path / "half_written")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def check_hf_folder(folder: Path, probe: torch.Tensor, logits: torch.Tensor) -> None:
    """The folder loads in plain transformers, gives the same logits and generates."""
    from transformers import AutoModelForCausalLM

    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=probe).logits, logits, rtol=1e-5, atol=1e-5)
        generated = loaded.generate(probe[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 9) and torch.equal(generated[:, :4], probe[:1, :4])


def test_save_hf_loads_in_plain_transformers(world, tmp_path):
    from transformers import AutoTokenizer

    from hpc_rlhf.engines.train import TrainEngine

    engine = TrainEngine(tiny_model(0, tie=True), train_cfg())
    run_steps(engine, global_batches(5, 2, 4))
    engine.save_hf(tmp_path / "hf", tokenizer=tiny_tokenizer())
    probe = global_batches(6, 1, 2)[0]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    check_hf_folder(tmp_path / "hf", probe, logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("t3 t5")["input_ids"] == [3, 5]


def cpu_adam_built() -> bool:
    """deepspeed's cpu_adam op is installed or already JIT-compiled (compiling it takes ~2 minutes)."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get("cpu_adam"):
        return True
    return (Path(_get_build_directory("cpu_adam", verbose=False)) / "cpu_adam.so").is_file()


def test_adam_offload_follows_the_same_trajectory(world):
    from hpc_rlhf.engines.train import TrainEngine

    if not cpu_adam_built():
        pytest.skip("deepspeed's cpu_adam op is not built (JIT build ~105 s here; install deepspeed with "
                    "DS_BUILD_CPU_ADAM=1 to prebuild it)")
    batches = global_batches(7, 4, 4)
    plain, _ = run_steps(TrainEngine(tiny_model(0), train_cfg(zero_stage=2)), batches)
    offloaded_engine = TrainEngine(tiny_model(0), train_cfg(zero_stage=2, adam_offload=True))
    assert type(offloaded_engine._optimizer).__name__ == "DeepSpeedCPUAdam"
    offloaded, _ = run_steps(offloaded_engine, batches)
    assert offloaded == pytest.approx(plain, rel=TRAJECTORY_RTOL)


# -------------------------------------------------------------------------------------------- distributed
def test_zero_stages_on_two_ranks_match_zero0_on_one(tmp_path):
    from tests.distributed import run_ranks

    run_ranks(2, __file__, "equivalence", str(tmp_path), timeout=150)
    result = json.loads((tmp_path / "equivalence.json").read_text())
    reference = result.pop("zero0_one_rank")
    assert len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0]
    for name, run in result.items():
        assert run["losses"] == pytest.approx(reference["losses"], rel=TRAJECTORY_RTOL), name
        assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=TRAJECTORY_RTOL), name
        assert run["lrs"] == pytest.approx(reference["lrs"], rel=1e-12), name


def test_two_roles_train_side_by_side_without_world_collectives(tmp_path):
    from tests.distributed import run_ranks

    run_ranks(4, __file__, "two-roles", str(tmp_path), timeout=170)
    result = {role: json.loads((tmp_path / f"{role}.json").read_text()) for role in ("zero3", "zero2")}
    for role in result.values():
        assert role["world_collectives"] == [] and role["bare_barrier_caught"]
    zero3, zero2 = result["zero3"], result["zero2"]
    assert zero3["global_step"] == 5 and zero2["global_step"] == 4
    assert zero3["resumed"] == zero3["continued"]  # exactly
    assert zero3["resumed_step"] == 3
    stream = zero3["stream"]
    assert 0 < stream["most_gathered"] <= stream["unit"] < stream["model"] and stream["logits_match"]
    assert zero2["losses"][-1] < zero2["losses"][0]
    probe = torch.load(tmp_path / "probe.pt")
    check_hf_folder(tmp_path / "hf", probe["input_ids"], probe["logits"])


# ------------------------------------------------------------------------------------------------ workers
def equivalence_worker(out_dir: str) -> None:
    """2 ranks: ZeRO-0 on one rank (a singleton group) vs ZeRO 1/2/3 on both, same global batches of 4."""
    import torch.distributed as dist

    from hpc_rlhf.engines.deepspeed_compat import singleton_group
    from hpc_rlhf.engines.train import TrainEngine

    out = Path(out_dir)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    batches = global_batches(11, STEPS, 4)

    def record(engine, local_losses, infos):
        losses = torch.tensor(local_losses, dtype=torch.float64)
        dist.all_reduce(losses)  # the global batch mean is the mean of the ranks' equal-sized shares
        return {"losses": (losses / ranks).tolist(), "grad_norms": [i.grad_norm for i in infos],
                "lrs": [i.lr for i in infos]}

    results = {}
    reference = TrainEngine(tiny_model(0), train_cfg(zero_stage=0), group=singleton_group())
    losses, infos = run_steps(reference, batches)
    results["zero0_one_rank"] = {"losses": losses, "grad_norms": [i.grad_norm for i in infos],
                                 "lrs": [i.lr for i in infos]}
    for name, stage, micro, checkpointing in [("zero1", 1, 2, False), ("zero2_accumulate2", 2, 1, False),
                                              ("zero3_checkpointing", 3, 2, True)]:
        model = tiny_model(0)
        calls = enable_counted_checkpointing(model) if checkpointing else None
        engine = TrainEngine(model, train_cfg(zero_stage=stage, micro_batch_size=micro))
        assert engine.gradient_accumulation_steps == 4 // (micro * ranks)
        results[name] = record(engine, *run_steps(engine, batches, rank, ranks))
        if checkpointing:
            assert calls[0] == STEPS * 2, calls  # steps x layers: checkpointing ran under ZeRO-3
    if rank == 0:
        (out / "equivalence.json").write_text(json.dumps(results))


def stream_one_module_at_a_time(engine, probe) -> dict:
    """Stream full_state() of a ZeRO-3 engine: at every tensor, at most one module's parameters are whole on
    this rank; the streamed weights give the engine's logits."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    module = engine.module
    unit = max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in module.modules())
    most, copies = 0, {}
    for name, tensor in engine.full_state():
        most = max(most, sum(p.ds_numel for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE))
        copies[name] = tensor.detach().clone()
    out = {"most_gathered": most, "unit": unit, "model": sum(p.ds_numel for p in module.parameters())}
    if engine.is_leader:
        plain = tiny_model(3, tie=True)
        plain.load_state_dict(copies)
        with torch.no_grad():
            out["logits_match"] = torch.allclose(plain(input_ids=probe).logits,
                                                 engine.module(input_ids=probe).logits, atol=1e-6)
    else:
        assert copies == {}
        with torch.no_grad():
            engine.module(input_ids=probe)  # the leader's check above is a collective pass
    return out


def two_roles_worker(out_dir: str) -> None:
    """4 ranks: ZeRO-3 on ranks 0-1 (saves, resumes), ZeRO-2 on ranks 2-3 (accumulation 2, other step count)."""
    import torch.distributed as dist

    from hpc_rlhf.engines.deepspeed_compat import WorldCollectiveError, forbid_world_collectives
    from hpc_rlhf.engines.train import TrainEngine

    out = Path(out_dir)
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank, same order
    group = groups[rank // 2]
    role_rank = dist.get_rank(group)
    report = {}
    with forbid_world_collectives() as found:
        try:
            dist.barrier()
            report["bare_barrier_caught"] = False
        except WorldCollectiveError:
            report["bare_barrier_caught"] = True
        found.clear()
        if rank < 2:
            name = "zero3"
            cfg = train_cfg(zero_stage=3, micro_batch_size=2, batch_size=4)
            batches = global_batches(21, 5, 4)
            engine = TrainEngine(tiny_model(0, tie=True), cfg, group=group)
            run_steps(engine, batches[:3], role_rank, 2)
            engine.save_checkpoint(out / "ckpt")
            engine.save_hf(out / "hf")
            probe = global_batches(22, 1, 2)[0]
            engine.eval()
            with torch.no_grad():
                logits = engine(input_ids=probe).logits
            if role_rank == 0:
                torch.save({"input_ids": probe, "logits": logits}, out / "probe.pt")
            # The RL step scores with the bare module: after training, its passes re-record DeepSpeed's trace,
            # whose check must stay in the role group (it broadcast over WORLD before keep_module_in_group).
            with torch.no_grad():
                for _ in range(3):
                    torch.testing.assert_close(engine.module(input_ids=probe).logits, logits)
            report["stream"] = stream_one_module_at_a_time(engine, probe)
            engine.train()
            report["continued"], _ = run_steps(engine, batches[3:], role_rank, 2)
            report["global_step"] = engine.global_step
            fresh = TrainEngine(tiny_model(7, tie=True), cfg, group=group)
            fresh.load_checkpoint(out / "ckpt")
            report["resumed_step"] = fresh.global_step
            report["resumed"], _ = run_steps(fresh, batches[3:], role_rank, 2)
        else:
            name = "zero2"
            engine = TrainEngine(tiny_model(1), train_cfg(zero_stage=2, micro_batch_size=1, batch_size=4),
                                 group=group)
            report["losses"], _ = run_steps(engine, global_batches(31, 4, 4), role_rank, 2)
            report["global_step"] = engine.global_step
            with engine.gathered_parameters():  # a no-op below ZeRO-3, but callers use it unconditionally
                pass
        report["world_collectives"] = [call.name for call in found]
    if role_rank == 0:
        (out / f"{name}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"equivalence": equivalence_worker, "two-roles": two_roles_worker})
    # Leave without the interpreter's teardown of the DeepSpeed engines still alive here: once in about six full
    # suites (2026-11-25) rank 1 of the equivalence run died there with "terminate called without an active
    # exception" (SIGABRT) after the results were written and checked. Cause not found; what is tested is above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
