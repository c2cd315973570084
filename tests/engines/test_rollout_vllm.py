"""The parts of the vLLM engine that run without vLLM: sampling translation, output conversion, spawn
environment, bucket layout and the worker-side loader (with fakes), and actor -> Hugging Face weight names."""

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.dist.weight_sync import Bucketer
from hpc_rlhf.engines.rollout import vllm as vr
from hpc_rlhf.engines.rollout.base import RolloutError, SamplingParams, hf_named_tensors, hf_param_name


# ---------------------------------------------------------------------------------------- sampling params
def test_sampling_kwargs_translate_every_field_and_space_the_seeds():
    sampling = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=48, stop_token_ids=(7,),
                              seed=100)
    kwargs = vr.vllm_sampling_kwargs(sampling, stop_ids=[2, 7], num_prompts=3)
    assert [kw["seed"] for kw in kwargs] == [100, 104, 108]  # vLLM adds 0..n-1 per sample: all 12 distinct
    expected = dict(n=4, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=48, stop_token_ids=[2, 7],
                    ignore_eos=False, logprobs=0, detokenize=False, skip_special_tokens=False)
    assert all({k: v for k, v in kw.items() if k != "seed"} == expected for kw in kwargs)
    unseeded = vr.vllm_sampling_kwargs(SamplingParams(top_k=5), stop_ids=[2], num_prompts=2)
    assert all("seed" not in kw and kw["top_k"] == 5 for kw in unseeded)


# ------------------------------------------------------------------------------------------ outputs
def completion(index, token_ids, logprobs, finish_reason):
    per_token = [{t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=-99.0)}
                 for t, lp in zip(token_ids, logprobs)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=per_token, finish_reason=finish_reason)


def test_outputs_become_a_rollout_batch_in_prompt_and_sample_order():
    outputs = [
        SimpleNamespace(outputs=[completion(1, [5, 6, 2], [-0.1, -0.2, -0.3], "stop"),
                                 completion(0, [8, 9, 10, 11], [-1.0, -1.5, -2.0, -2.5], "length")]),
        # A stop token followed by more tokens (an engine that returns them): cut after the stop token.
        SimpleNamespace(outputs=[completion(0, [4, 7, 3, 3], [-0.5, -0.6, -0.7, -0.8], "stop"),
                                 completion(1, [2], [-0.05], "stop")]),
    ]
    batch = vr.rollout_batch_from_outputs([[1, 4], [1]], outputs, SamplingParams(n=2, max_new_tokens=4), [2, 7])
    assert [[t.tolist() for t in per] for per in batch.responses] == [[[8, 9, 10, 11], [5, 6, 2]], [[4, 7], [2]]]
    expected = [[[-1.0, -1.5, -2.0, -2.5], [-0.1, -0.2, -0.3]], [[-0.5, -0.6], [-0.05]]]
    for got_row, want_row in zip(batch.flat_logprobs(), [row for per in expected for row in per]):
        torch.testing.assert_close(got_row, torch.tensor(want_row))
    assert batch.finish_reasons == [["length", "stop"], ["stop", "stop"]]
    assert batch.prompt_ids == [[1, 4], [1]]


def test_incomplete_outputs_are_refused_with_the_prompt_named():
    sampling = SamplingParams(n=1, max_new_tokens=4)
    no_logprobs = SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[5], logprobs=None,
                                                           finish_reason="length")])
    with pytest.raises(RolloutError, match="prompt 0 sample 0 no log-prob"):
        vr.rollout_batch_from_outputs([[1]], [no_logprobs], sampling, [2])
    aborted = SimpleNamespace(outputs=[completion(0, [5], [-1.0], "abort")])
    with pytest.raises(RolloutError, match="reason 'abort'"):
        vr.rollout_batch_from_outputs([[1]], [aborted], sampling, [2])
    with pytest.raises(RolloutError, match="2 samples for prompt 0, expected n=1"):
        vr.rollout_batch_from_outputs([[1]], [SimpleNamespace(outputs=[completion(0, [5], [-1.0], "length")] * 2)],
                                      sampling, [2])
    with pytest.raises(RolloutError, match="1 results for 2 prompts"):
        vr.rollout_batch_from_outputs([[1], [1]], [aborted], sampling, [2])


# ------------------------------------------------------------------------------------- engine plumbing
def test_engine_kwargs_name_an_importable_worker_extension_and_processed_logprobs():
    kwargs = vr.engine_kwargs("/models/actor", tensor_parallel_size=2, dtype="bfloat16", gpu_memory_utilization=0.4,
                              seed=3, enable_sleep_mode=True, max_model_len=None, enforce_eager=False,
                              extra={"enable_prefix_caching": False})
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["distributed_executor_backend"] == "mp"
    assert "max_model_len" not in kwargs and kwargs["enable_prefix_caching"] is False
    module, cls = kwargs["worker_extension_cls"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls) is vr.WorkerExtension
    single = vr.engine_kwargs("/m", tensor_parallel_size=1, dtype="auto", gpu_memory_utilization=0.3, seed=0,
                              enable_sleep_mode=False, max_model_len=512, enforce_eager=True)
    assert "distributed_executor_backend" not in single and single["max_model_len"] == 512


def test_spawn_environment_hides_our_launcher_and_restores_everything(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(KeyError):
        with vr.spawn_environment([2, 3]):
            assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
            assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
            raise KeyError("vLLM failed to start")
    assert os.environ["RANK"] == "3" and os.environ["MASTER_PORT"] == "29500"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


def test_creating_an_engine_without_vllm_gives_one_clear_error():
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    with pytest.raises(RolloutError, match="needs the vllm package"):
        vr.VLLMRolloutEngine("/models/actor", eos_id=2)


def test_worker_extension_loads_a_bucket_from_the_gpu_named_by_uuid(monkeypatch):
    """The worker side with its CUDA parts faked: rebuild the buffer on the right device, load every view."""
    tensors = [("model.embed_tokens.weight", torch.randn(5, 4)), ("model.norm.weight", torch.randn(4)),
               ("lm_head.weight", torch.randn(5, 4))]
    (bucket,) = Bucketer(1 << 20, torch.device("cpu")).buckets(tensors)
    layout = vr.bucket_layout(bucket)
    assert layout == [("model.embed_tokens.weight", (5, 4), 0), ("model.norm.weight", (4,), 20),
                      ("lm_head.weight", (5, 4), 24)]
    seen_devices, loaded = [], []

    def rebuild(*args):
        seen_devices.append(args[6])
        return bucket.flat

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    worker = vr.WorkerExtension()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: loaded.extend(weights)))
    handle = (rebuild, ("cls", "size", "stride", 0, "storage", "dtype", 0, "handle"))
    assert worker.hpc_rlhf_load_bucket(handle, "GPU-1", layout) == 3
    assert seen_devices == [1]
    assert [n for n, _ in loaded] == [n for n, _ in tensors]
    assert all(torch.equal(got, t) for (_, got), (_, t) in zip(loaded, tensors))
    with pytest.raises(RolloutError, match="GPU-7, which this vLLM worker cannot see"):
        worker.hpc_rlhf_load_bucket(handle, "GPU-7", layout)


# ------------------------------------------------------------------------------------------ weight names
@pytest.mark.parametrize("wrapped, plain", [
    ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("module.base_model.model.model.layers.1.self_attn.q_proj.base_layer.bias", "model.layers.1.self_attn.q_proj.bias"),
    ("module.base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight", None),
    ("base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight", None),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", None),
    ("base_model.model.lm_head.original_module.weight", None),
])
def test_actor_names_map_to_hugging_face_names(wrapped, plain):
    assert hf_param_name(wrapped) == plain


def test_a_merged_peft_actor_wrapped_like_deepspeed_loads_into_a_plain_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

    def tiny(seed):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))

    actor = get_peft_model(tiny(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in actor.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make the adapters matter
            torch.nn.init.normal_(p, std=0.5)
    actor.merge_adapter()
    wrapped = torch.nn.Module()
    wrapped.module = actor  # what DeepSpeed's engine does: parameter names gain "module."
    engine = HFRolloutEngine(tiny(1), pad_id=0, eos_id=1)
    engine.load_weights(hf_named_tensors(wrapped.named_parameters()))
    actor.unmerge_adapter()
    expected = actor.merge_and_unload().state_dict()
    got = engine.model.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
