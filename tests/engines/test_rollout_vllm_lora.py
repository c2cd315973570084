"""The vLLM engine of a LoRA actor on CPU (vLLM's CPU build), for real: rank 0 plays a LoRA actor and streams its
adapter alone over the weight-sync group, rank 1 drives a vLLM engine started over the actor's base folder with
`lora=` (issue 27). After each sync the engine's greedy tokens and sampling log-probs must equal those of the actor
with its adapter merged into the weights (transformers, fp32: within 1e-4), and a final adapter folder saved with
`merge_on_save=false` must load into vLLM and give the same tokens.

Cost: one vLLM engine start (~25-50 s on 2 cores) and a few generations.
"""

import json

import pytest
import torch

from hpc_rlhf.config import TINY_ASSETS, LoraSection
from tests.distributed import REPO, run_ranks

TINY = str(REPO / TINY_ASSETS / "models" / "llama-tiny")
EOS = 2
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 20, 21, 22, 23, 24], [1, 30, 31], [1, 40, 41, 42]]
LORA = LoraSection(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])


def lora_actor(seed: int):
    """The LoRA actor after `seed` updates: the tiny model with an adapter of seeded random weights (the same on
    both ranks; peft starts B at zero, which would make the adapter invisible)."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32), LORA).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def merged(actor):
    """The actor with its adapter folded into the weights, as a plain transformers model."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.lora import merged_state_dict

    plain = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    plain.load_state_dict(merged_state_dict(actor))
    return plain


def teacher_forced(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def _rank_main(out: str, folder: str) -> None:
    import torch.distributed as dist

    from hpc_rlhf.dist import weight_sync
    from hpc_rlhf.engines.rollout import vllm as vr
    from hpc_rlhf.engines.rollout.base import SamplingParams
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
    from hpc_rlhf.models.lora import adapter_tensors, save_model

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    if rank == 0:
        for seed in (1, 2):
            stats = weight_sync.send_weights(adapter_tensors(lora_actor(seed)), src=0, group=group, bucket_mb=0.05,
                                             reuse_layout=True)
            dist.broadcast_object_list([stats.bytes], src=0, group=group)
        dist.barrier()
        return
    engine = vr.VLLMRolloutEngine(TINY, EOS, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_mb=64,
                                  seed=0, lora=LORA)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    sampled = SamplingParams(n=4, temperature=0.8, max_new_tokens=8, seed=123)
    result = {}

    def compare(tag, expected_model):
        ours = engine.generate(PROMPTS, greedy)
        theirs = HFRolloutEngine(expected_model, pad_id=0, eos_id=EOS).generate(PROMPTS, greedy)
        result[f"{tag}_greedy"] = [[t.tolist() for t in ours.flat_responses()],
                                   [t.tolist() for t in theirs.flat_responses()]]
        result[f"{tag}_greedy_lp_gap"] = max(float((a - b).abs().max()) for a, b in
                                             zip(ours.flat_logprobs(), theirs.flat_logprobs()) if a.shape == b.shape)
        drawn = engine.generate(PROMPTS, sampled)
        result[f"{tag}_sampled_lp_gap"] = max(
            float((lp - teacher_forced(expected_model, PROMPTS[i // 4], t.tolist(), 0.8)).abs().max())
            for i, (t, lp) in enumerate(zip(drawn.flat_responses(), drawn.flat_logprobs())))

    from transformers import AutoModelForCausalLM

    compare("base", AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval())
    for seed in (1, 2):
        stats = weight_sync.receive_weights(src=0, group=group, load_fn=engine.load_adapter)
        sent = [None]
        dist.broadcast_object_list(sent, src=0, group=group)
        result[f"sync{seed}_bytes"] = [stats.bytes, sent[0]]
        compare(f"sync{seed}", merged(lora_actor(seed)))
        result[f"sync{seed}_version"] = engine.adapter_version
    # final/ as merge_on_save=false writes it: a PEFT folder, served by vLLM as it is
    from vllm.lora.request import LoRARequest

    save_model(lora_actor(3), folder, merge=False)
    request = LoRARequest("final", 1000, folder)
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                  engine._vllm.SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[EOS],
                                                              detokenize=False),
                                  use_tqdm=False, lora_request=request)
    expected = HFRolloutEngine(merged(lora_actor(3)), pad_id=0, eos_id=EOS).generate(PROMPTS, greedy)
    result["final_folder"] = [[list(o.outputs[0].token_ids) for o in outputs],
                              [t.tolist() for t in expected.flat_responses()]]
    engine.close()
    dist.barrier()
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_lora")
    run_ranks(2, __file__, "engine", str(root / "result.json"), str(root / "final"), timeout=600)
    return json.loads((root / "result.json").read_text())


def test_after_each_adapter_sync_vllm_generates_as_the_merged_actor(run):
    for tag in ("base", "sync1", "sync2"):
        ours, theirs = run[f"{tag}_greedy"]
        assert ours == theirs, tag
        assert run[f"{tag}_greedy_lp_gap"] < 1e-4, tag
        assert run[f"{tag}_sampled_lp_gap"] < 1e-4, tag
    assert run["base_greedy"][0] != run["sync1_greedy"][0] != run["sync2_greedy"][0]  # the adapters mattered
    assert run["sync2_version"] == 2  # a new LoRA version per sync


def test_the_sync_moves_the_adapter_alone(run):
    # r * (in + out) per adapted layer: q and o 128 -> 128, k and v 128 -> 64 (2 KV heads), up 128 -> 512; rank 8,
    # 2 layers, fp32: 96 KB, where the whole model is 2.1 MB
    received, sent = run["sync1_bytes"]
    assert received == sent == 8 * (2 * (128 + 128) + 2 * (128 + 64) + (128 + 512)) * 2 * 4


def test_an_adapter_folder_saved_alone_is_served_by_vllm(run):
    ours, theirs = run["final_folder"]
    assert ours == theirs


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"engine": _rank_main})
