"""The padding-free layout of the RL roles' forwards (hpc_rlhf/rl/packed.py, rl.padding_free): where each sample goes
in the packed rows, that the conversions back to the padded layout put every value at its place, and that each role
(actor and LoRA reference log-probs, critic values, reward-model scores, a process reward model's step scores, and
the actor's and critic's gradients, an episode's holes in the action mask included) computes on packed rows what it computes on padded ones."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForTokenClassification

from hpc_rlhf.algorithms.logprobs import masked_sum
from hpc_rlhf.config import LoraSection
from hpc_rlhf.models.dropout import disable_dropout
from hpc_rlhf.models.lora import apply_lora
from hpc_rlhf.models.value_model import set_reward_normalization
from hpc_rlhf.rl import scoring
from hpc_rlhf.rl.batches import make_batch
from hpc_rlhf.rl.metrics import pad_share
from hpc_rlhf.rl.packed import (PADDED, Layout, pack_batch, policy_forward, processed_tokens, unpack_next_token,
                                unpack_tokens, value_forward)
from hpc_rlhf.runtime.process_rewards import ProcessRewardSpec
from tests.models.conftest import tiny_config

PAD = 0
# Samples of 5, 6, 3 and 4 tokens: rows as long as the longest (6) hold [6], [5], [4] and [3] after first-fit
# decreasing can put no two together; rows of 9 hold [6, 3] and [5, 4].
PROMPTS = [[1, 5, 6], [1, 7], [1], [1, 9, 3]]
RESPONSES = [torch.tensor([8, 9]), torch.tensor([10, 11, 12, 4]), torch.tensor([14, 15]), torch.tensor([13])]
LAYOUTS = {"padded": PADDED, "packed_longest": Layout(True, PAD, 0), "packed_9": Layout(True, PAD, 9)}
TOLERANCE = 1e-5  # float32 rounding: attention over rows of other widths sums in another order


def tiny(model_class, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return model_class(tiny_config("llama", **overrides)).eval()


def batch(masks=None):
    return make_batch(PROMPTS, RESPONSES, PAD, masks=masks)


def alone(prompt, response) -> torch.Tensor:
    return torch.tensor([prompt + response.tolist()])


# ------------------------------------------------------------------------------------------------------ layout
def test_samples_go_whole_into_rows_first_fit_decreasing_with_positions_restarting():
    packed = pack_batch(batch(), PAD, row_tokens=9)
    assert packed.lengths == [5, 6, 3, 4] and packed.width == 6
    assert packed.input_ids.shape == (2, 9)
    # longest first: 6 opens row 0, 5 opens row 1, 4 joins the 5, 3 joins the 6; in sample order within a row
    assert (packed.row, packed.offset) == ([1, 0, 0, 1], [0, 0, 6, 5])
    assert packed.input_ids[0].tolist() == [1, 7, 10, 11, 12, 4, 1, 14, 15]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert packed.input_ids[1].tolist() == [1, 5, 6, 8, 9, 1, 9, 3, 13]
    assert packed.cu_seqlens.tolist() == [0, 6, 9, 14, 18] and packed.max_seqlen == 6
    assert packed.last_token_index().tolist() == [13, 5, 8, 17]


def test_rows_as_long_as_the_longest_sample_end_in_a_padding_block_of_their_own():
    packed = pack_batch(batch(), PAD)
    assert packed.input_ids.shape == (4, 6) and packed.row == [1, 0, 3, 2]
    assert packed.input_ids[3].tolist() == [1, 14, 15, PAD, PAD, PAD]
    assert packed.position_ids[3].tolist() == [0, 1, 2, 0, 1, 2]  # the pads: a sequence of their own
    assert packed.cu_seqlens.tolist() == [0, 6, 11, 12, 16, 18, 21, 24]
    with pytest.raises(ValueError, match="a sample of 6 tokens does not fit rows of 5 tokens"):
        pack_batch(batch(), PAD, row_tokens=5)


def test_unpacking_puts_every_value_at_its_padded_place_and_zero_elsewhere():
    padded = batch()
    packed = pack_batch(padded, PAD, row_tokens=9)
    tokens = packed.input_ids.float()  # a per-token value that says which token it belongs to
    assert torch.equal(unpack_tokens(tokens, packed), (padded.input_ids * padded.attention_mask).float())
    next_tokens = packed.input_ids[:, 1:].float()  # position t "predicts" token t + 1
    want = padded.input_ids[:, 1:].float() * padded.attention_mask[:, 1:]
    assert torch.equal(unpack_next_token(next_tokens, packed), want)


def test_the_pad_share_counts_the_pads_of_either_layout():
    lengths = [5, 6, 3, 4]
    assert processed_tokens(lengths, micro=4, padding_free=False) == 24
    assert processed_tokens(lengths, micro=2, padding_free=False) == 2 * 6 + 2 * 4
    assert processed_tokens(lengths, micro=4, padding_free=True, row_tokens=9) == 18  # two full rows
    assert processed_tokens(lengths, micro=4, padding_free=True) == 24  # nothing fits beside another in 6
    assert pad_share(batch(), 4, PADDED) == pytest.approx(1 - 18 / 24)
    assert pad_share(batch(), 4, Layout(True, PAD, 9)) == 0.0


def test_flash_attention_gets_the_sequence_bounds():
    packed = pack_batch(batch(), PAD, row_tokens=9)
    kwargs = packed.model_kwargs("flash_attention_2")
    assert torch.equal(kwargs["cu_seq_lens_q"], packed.cu_seqlens) and kwargs["max_length_k"] == 6
    assert "attention_mask" not in kwargs and kwargs["use_cache"] is False
    assert "cu_seq_lens_q" not in packed.model_kwargs("sdpa")


# ------------------------------------------------------------------------------------------ each role's forward
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_actor_log_probs_are_each_samples_own_in_either_layout(layout):
    model = tiny(LlamaForCausalLM)
    got = scoring.logprobs_of(model, temperature=0.7, layout=layout)(batch())
    for prompt, response, logprobs in zip(PROMPTS, RESPONSES, got, strict=True):
        with torch.no_grad():
            logits = model(input_ids=alone(prompt, response)).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1:-1] / 0.7, -1).gather(1, response[:, None]).squeeze(1)
        assert logprobs.shape == response.shape and torch.allclose(logprobs, want, atol=TOLERANCE)


@pytest.mark.parametrize("layout", list(LAYOUTS.values())[1:], ids=list(LAYOUTS)[1:])
def test_the_reference_of_a_lora_actor_on_packed_rows_is_its_base_model_on_padded_ones(layout):
    base = tiny(LlamaForCausalLM)
    actor = apply_lora(tiny(LlamaForCausalLM), LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in actor.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    plain = scoring.logprobs_of(base, temperature=1.0)(batch())
    reference = scoring.logprobs_of(actor, temperature=1.0, adapter_off=True, layout=layout)(batch())
    adapted = scoring.logprobs_of(actor, temperature=1.0, layout=layout)(batch())
    adapted_padded = scoring.logprobs_of(actor, temperature=1.0)(batch())
    assert all(torch.allclose(a, b, atol=TOLERANCE) for a, b in zip(reference, plain, strict=True))
    assert all(torch.allclose(a, b, atol=TOLERANCE) for a, b in zip(adapted, adapted_padded, strict=True))
    assert not any(torch.allclose(a, b, atol=1e-3) for a, b in zip(adapted, plain, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_critic_values_and_reward_scores_are_each_samples_own_in_either_layout(layout):
    critic = tiny(LlamaForTokenClassification, num_labels=1)
    reward_model = tiny(LlamaForTokenClassification, seed=1, num_labels=1)
    set_reward_normalization(reward_model, mean=0.5, std=2.0)
    values = scoring.values_of(critic, layout)(batch())
    scores = scoring.scores_of(reward_model, normalize=True, layout=layout)(batch())
    for prompt, response, value, score in zip(PROMPTS, RESPONSES, values, scores, strict=True):
        with torch.no_grad():
            per_token = critic(input_ids=alone(prompt, response)).logits[0, :, 0]
            last = reward_model(input_ids=alone(prompt, response)).logits[0, -1, 0].reshape(1)
        want = per_token[len(prompt) - 1:len(prompt) - 1 + len(response)]
        assert value.shape == response.shape and torch.allclose(value, want, atol=TOLERANCE)
        assert torch.allclose(score, (last - 0.5) / 2.0, atol=TOLERANCE)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_process_reward_scores_are_each_samples_own_steps_in_either_layout(layout):
    prm = tiny(LlamaForCausalLM, seed=2)
    spec = ProcessRewardSpec(marker_id=9, reward_ids=(10, 11))
    # Markers (9): two steps in the first response, one in the second and third, none in the fourth (its prompt's
    # is no step). Rows of 9 hold the samples of 6 and 3 tokens, and of 5 and 4: the third starts at offset 5.
    prompts = [[1, 9], [1, 5, 6, 7], [1, 9], [1, 9]]
    responses = [torch.tensor([8, 9, 10, 9]), torch.tensor([9]), torch.tensor([9, 12]), torch.tensor([11])]
    got = scoring.process_scores_of(prm, spec, "min", layout)(make_batch(prompts, responses, PAD))
    for prompt, response, reward in zip(prompts, responses, got, strict=True):
        with torch.no_grad():
            logits = prm(input_ids=alone(prompt, response)).logits[0]
        steps = [len(prompt) + t for t, token in enumerate(response.tolist()) if token == 9]
        want = min((torch.softmax(logits[j, [10, 11]], -1)[0].item() for j in steps), default=0.0)
        assert reward.shape == (1,) and reward.item() == pytest.approx(want, abs=TOLERANCE)
    assert got[3].item() == 0.0 and all(0 < reward.item() < 1 for reward in got[:3])


def gradients(model, loss) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("row_tokens", [0, 9])
def test_training_gradients_on_packed_rows_are_those_on_padded_ones_holes_in_the_mask_included(row_tokens):
    """The actor's loss terms (log-probs and entropy on the loss mask) and the critic's values: the same gradient
    in both layouts. The mask has holes where an episode's observations are (tokens the model did not generate)."""
    masks = [torch.tensor([1, 1]), torch.tensor([1, 0, 0, 1]), torch.tensor([0, 1]), torch.tensor([1])]
    sub = batch(masks)
    mask = sub.action_mask
    packed = Layout(True, PAD, row_tokens)
    actor, critic = tiny(LlamaForCausalLM).train(), tiny(LlamaForTokenClassification, num_labels=1).train()
    disable_dropout(actor)  # as the recipe does: the token-classification head's dropout would differ by draw
    disable_dropout(critic)
    grads = {}
    for name, layout in (("padded", PADDED), ("packed", packed)):
        logps, entropies = policy_forward(actor, sub, 0.8, layout)
        actor_grad = gradients(actor, masked_sum(logps * torch.linspace(-1, 1, logps.shape[1]), mask)
                               - 0.1 * masked_sum(entropies(), mask))
        values = value_forward(critic, sub, layout)[:, :-1]
        critic_grad = gradients(critic, masked_sum((values - 1.0) ** 2, mask))
        grads[name] = (actor_grad, critic_grad, logps.detach() * mask)
    for padded, packed_ in zip(grads["padded"], grads["packed"]):
        assert torch.allclose(padded, packed_, atol=1e-5, rtol=1e-4)
    assert grads["padded"][0].abs().sum() > 0 and grads["padded"][1].abs().sum() > 0
