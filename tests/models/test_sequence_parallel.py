"""Sequence parallelism (hpc_rlhf/models/sequence_parallel.py, used by hpc_rlhf/rl/packed.py): K ranks sharing one
packed row compute the log-probs, entropies, values and reward scores that one rank computes on the whole row, and
their parameter gradients add up to its gradient, for K = 2 (each rank receives its own key/value head) and K = 4
(the model's two key/value heads repeated for its four query heads), on rows with several samples and an episode's
holes in the loss mask. The pure pieces (chunk bounds, the attention mask of packed rows) are checked in one
process."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.models.sequence_parallel import SequenceContext, SequenceShard, enable, inner_attention
from tests.distributed import run_ranks

PAD = 0
# Samples of 5, 6, 3, 4 and 7 tokens; the loss mask has holes where an episode's observations are.
PROMPTS = [[1, 5, 6], [1, 7], [1], [1, 9, 3], [1, 4, 4]]
RESPONSES = [[8, 9], [10, 11, 12, 4], [14, 15], [13], [20, 21, 22, 23]]
MASKS = [[1, 1], [1, 0, 0, 1], [0, 1], [1], [1, 1, 0, 1]]
TOLERANCE = 2e-5  # float32: attention over a row split otherwise sums in another order


def test_chunk_bounds_split_a_row_evenly_and_refuse_what_does_not_split():
    shard = SequenceShard(None, 4, 2)
    assert shard.bounds(12) == (6, 9)
    with pytest.raises(ValueError, match="a row of 10 tokens does not split into 4 equal chunks"):
        shard.bounds(10)


def test_attention_runs_within_each_sample_of_a_packed_row():
    context = SequenceContext(SequenceShard(None, 2, 0), torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]]))
    assert context.sample_bounds() == [[(0, 3), (3, 5), (5, 6)], [(0, 2), (2, 6)]]
    cu_seqlens, longest = context.cu_seqlens()
    assert cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12] and longest == 4


def test_enabling_wraps_the_attention_backend_and_leaves_whole_sequence_forwards_unchanged():
    from transformers import LlamaForCausalLM

    from tests.models.conftest import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama")).eval()
    ids = torch.tensor([[1, 5, 6, 8, 9], [1, 7, 10, 0, 0]])
    mask = (ids != PAD).long()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        assert enable(model) == "sequence_parallel_sdpa" and enable(model) == "sequence_parallel_sdpa"
        after = model(input_ids=ids, attention_mask=mask).logits
    assert inner_attention(model.config._attn_implementation) == "sdpa"
    assert torch.allclose(before, after, atol=1e-6)


def test_whole_sequence_forwards_run_the_inner_backend_under_its_own_name(monkeypatch):
    """transformers' flash-attention forward finds its kernel by the config's implementation name: while the
    wrapper hands a whole-sequence forward on, the name is the inner backend's, and ours again after."""
    from types import SimpleNamespace

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hpc_rlhf.models import sequence_parallel

    seen = []

    def inner(module, query, key, value, attention_mask, **kwargs):
        seen.append(module.config._attn_implementation)
        return query, None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", inner)
    module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sequence_parallel_flash_attention_2"),
                             training=False)
    query = torch.zeros(1, 4, 3, 8)
    out, _ = sequence_parallel._attention_for("flash_attention_2")(module, query, query, query, None)
    assert out is query and seen == ["flash_attention_2"]
    assert module.config._attn_implementation == "sequence_parallel_flash_attention_2"


@pytest.mark.parametrize("k", [2, 4])
def test_k_ranks_sharing_rows_compute_what_one_rank_computes(k):
    run_ranks(4, __file__, "equal", str(k), timeout=240)


# ----------------------------------------------------------------------------------------------- rank worker
def _equal(k: str) -> None:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, LlamaForTokenClassification

    from hpc_rlhf.algorithms.logprobs import masked_sum
    from hpc_rlhf.models.dropout import disable_dropout
    from hpc_rlhf.models.value_model import set_reward_normalization
    from hpc_rlhf.rl.batches import make_batch
    from hpc_rlhf.rl.packed import Layout, policy_forward, score_forward, value_forward
    from tests.models.conftest import tiny_config

    k, rank = int(k), dist.get_rank()
    blocks = [tuple(range(start, start + k)) for start in range(0, dist.get_world_size(), k)]
    groups = [dist.new_group(list(block)) for block in blocks]  # every rank enters every group, in order
    mine = next(i for i, block in enumerate(blocks) if rank in block)
    shard = SequenceShard(groups[mine], k, blocks[mine].index(rank))

    def tiny(model_class, seed, **overrides):
        torch.manual_seed(seed)
        model = model_class(tiny_config("llama", **overrides)).train()
        disable_dropout(model)
        return model

    actor = tiny(LlamaForCausalLM, 0)
    critic = tiny(LlamaForTokenClassification, 1, num_labels=1)
    reward_model = tiny(LlamaForTokenClassification, 2, num_labels=1).eval()
    set_reward_normalization(reward_model, mean=0.5, std=2.0)
    sub = make_batch(PROMPTS, [torch.tensor(r) for r in RESPONSES], PAD, masks=[torch.tensor(m) for m in MASKS])
    mask = sub.action_mask
    weights = torch.linspace(-1, 1, mask.shape[1])

    def figures(layout):
        actor.zero_grad()
        critic.zero_grad()
        logps, entropies = policy_forward(actor, sub, 0.8, layout)
        entropy = entropies()
        (masked_sum(logps * weights, mask) - 0.1 * masked_sum(entropy, mask)).backward()
        values = value_forward(critic, sub, layout)[:, :-1]
        masked_sum((values - 1.0) ** 2, mask).backward()
        with torch.no_grad():
            scores = score_forward(reward_model, sub, True, layout)
        grads = [torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]) for m in (actor, critic)]
        return {"logps": logps.detach() * mask, "entropies": entropy.detach() * mask,
                "values": values.detach() * mask, "scores": scores, "actor_grad": grads[0], "critic_grad": grads[1]}

    for row_tokens in (0, 11):  # rows as long as the longest sample (7: padded to a multiple of K), or of 11
        whole = figures(Layout(True, PAD, row_tokens))
        for model in (actor, critic, reward_model):
            enable(model)
        shared = figures(Layout(True, PAD, row_tokens).with_sequence(shard))
        for name in ("actor_grad", "critic_grad"):  # the block's parts of one gradient
            dist.all_reduce(shared[name], group=shard.group)
        for name, want in whole.items():
            got = shared[name]
            assert got.shape == want.shape, (name, got.shape, want.shape)
            gap = (got - want).abs().max().item()
            assert gap < TOLERANCE * max(1.0, want.abs().max().item()), (k, row_tokens, name, gap)
        assert whole["actor_grad"].abs().sum() > 0 and whole["critic_grad"].abs().sum() > 0
        for model in (actor, critic, reward_model):  # back to plain sdpa for the next layout's reference
            for config in {id(c): c for c in [model.config, getattr(model, "model", model).config]}.values():
                config._attn_implementation = "sdpa"
    print(f"OK rank {rank}: K={k} equal")


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"equal": _equal})
