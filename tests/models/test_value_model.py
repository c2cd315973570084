"""Reward models and critics: per-token values, last-token scores, save/load, folder kinds."""

from __future__ import annotations

import logging

import pytest
import torch

from hpc_rlhf.config import ModelSection
from hpc_rlhf.models.builders import ModelFolderError
from hpc_rlhf.models.value_model import (build_value_model, fold_reward_normalization, gather_last, last_token_index,
                                         position_ids_from_mask, reward_normalization, save_value_model,
                                         sequence_scores, set_reward_normalization, token_values)
from tests.models.conftest import FAMILIES, make_model_folder, padded_batch


@pytest.fixture(scope="module")
def causal_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("causal")
    return {family: make_model_folder(root / family, family) for family in FAMILIES}


def left_padded(ids: torch.Tensor, mask: torch.Tensor, pad_id: int = 0):
    """The same rows with their padding moved to the left."""
    lengths = mask.sum(-1)
    width = ids.shape[1]
    left_ids = torch.full_like(ids, pad_id)
    left_mask = torch.zeros_like(mask)
    for row, n in enumerate(lengths.tolist()):
        left_ids[row, width - n:] = ids[row, :n]
        left_mask[row, width - n:] = 1
    return left_ids, left_mask


# -------------------------------------------------------------------------------------------- pure maths
def test_last_token_index_right_left_and_no_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1],
                         [1, 1, 1, 1, 1],
                         [0, 1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 1]


def test_last_token_index_rejects_empty_rows_and_bad_shapes():
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        last_token_index(torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="must be \\(batch, time\\)"):
        last_token_index(torch.ones(4))


def test_gather_last():
    values = torch.tensor([[0.5, 1.5, -2.0, 9.0],
                           [3.0, 4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1, 0],
                         [0, 0, 1, 1]])
    assert gather_last(values, mask).tolist() == [-2.0, 6.0]


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1],
                         [1, 1, 1, 0, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2],
                                                     [0, 1, 2, 2, 2]]


# -------------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("family", FAMILIES)
def test_value_model_from_causal_lm_keeps_the_body_and_trains(family, causal_folders):
    from transformers import AutoModelForCausalLM

    model = build_value_model(ModelSection(path=str(causal_folders[family])))
    assert type(model).__name__.endswith("ForTokenClassification") and model.config.num_labels == 1
    causal = AutoModelForCausalLM.from_pretrained(causal_folders[family]).state_dict()
    body = model.state_dict()
    body_keys = [k for k in causal if k.startswith("model.")]
    assert body_keys and all(torch.equal(body[k], causal[k]) for k in body_keys)
    assert torch.count_nonzero(model.score.bias) == 0
    assert 0.05 < model.score.weight.std().item() < 0.4  # about 1/sqrt(33) = 0.17

    ids, mask = padded_batch()
    values = token_values(model, ids, mask)
    assert values.shape == (3, 9) and values.dtype == torch.float32
    assert torch.all(values[mask == 0] == 0) and torch.all(values[mask == 1] != 0)
    scores = sequence_scores(model, ids, mask)
    assert scores.tolist() == [values[0, 8].item(), values[1, 6].item(), values[2, 4].item()]
    (scores.pow(2).sum() + values.sum()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_values_do_not_depend_on_dropout_in_training_mode(causal_folders):
    model = build_value_model(ModelSection(path=str(causal_folders["llama"])))
    assert model.training
    ids, mask = padded_batch(seed=3)
    torch.testing.assert_close(token_values(model, ids, mask), token_values(model, ids, mask), atol=0, rtol=0)


def test_new_head_is_announced_once_and_transformers_report_is_silenced(causal_folders, caplog, capfd):
    with caplog.at_level(logging.INFO):
        build_value_model(ModelSection(path=str(causal_folders["llama"])))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "score head (score.bias, score.weight) is newly initialised" in warnings[0]
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "newly initialized" not in err and "were not sharded" not in err


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_left_and_right_padding_give_the_same_scores(family, causal_folders):
    model = build_value_model(ModelSection(path=str(causal_folders[family])), for_training=False)
    ids, mask = padded_batch(seed=4)
    left_ids, left_mask = left_padded(ids, mask)
    assert not torch.equal(left_mask, mask)
    right = token_values(model, ids, mask)
    left = token_values(model, left_ids, left_mask)
    torch.testing.assert_close(sequence_scores(model, left_ids, left_mask), sequence_scores(model, ids, mask),
                               atol=1e-5, rtol=1e-5)
    for row in range(ids.shape[0]):
        torch.testing.assert_close(left[row][left_mask[row] == 1], right[row][mask[row] == 1], atol=1e-5, rtol=1e-5)


def test_save_and_load_give_identical_scores(causal_folders, tmp_path):
    from transformers import AutoModelForTokenClassification

    model = build_value_model(ModelSection(path=str(causal_folders["qwen2"])), for_training=False)
    set_reward_normalization(model, mean=0.25, std=2.0)
    ids, mask = padded_batch(seed=5)
    before = sequence_scores(model, ids, mask)
    save_value_model(model, tmp_path / "rm")

    loaded = build_value_model(ModelSection(path=str(tmp_path / "rm"), init_value_head=False), for_training=False)
    assert torch.equal(sequence_scores(loaded, ids, mask), before)
    assert reward_normalization(loaded) == (0.25, 2.0)
    torch.testing.assert_close(sequence_scores(loaded, ids, mask, normalize=True), (before - 0.25) / 2.0)
    # A plain Hugging Face folder: transformers alone loads the head.
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "rm").eval()
    assert torch.equal(sequence_scores(plain, ids, mask), before)


def test_reward_normalization_defaults_and_checks(causal_folders):
    model = build_value_model(ModelSection(path=str(causal_folders["llama"])), for_training=False)
    assert reward_normalization(model) == (0.0, 1.0)
    with pytest.raises(ValueError, match="positive std"):
        set_reward_normalization(model, mean=0.0, std=0.0)


def test_sequence_classification_reward_model_is_scored_at_the_last_token(tmp_path):
    from transformers import AutoModelForSequenceClassification

    folder = make_model_folder(tmp_path / "seqcls", model_class=AutoModelForSequenceClassification, num_labels=1)
    model = build_value_model(ModelSection(path=str(folder), init_value_head=False), for_training=False)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    # Pad id 0 never occurs inside these rows, so transformers' own pooling (by pad id) is a fair reference.
    ids, mask = padded_batch(seed=6)
    reference = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    expected = reference(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(sequence_scores(model, ids, mask), expected, atol=1e-5, rtol=1e-5)


def test_sequence_classification_without_pad_id_still_scores_batches(tmp_path):
    # transformers refuses batches of such a model; the scores here come from the attention mask instead.
    from transformers import AutoModelForSequenceClassification

    folder = make_model_folder(tmp_path / "nopad", model_class=AutoModelForSequenceClassification, num_labels=1,
                               pad_token_id=None)
    model = build_value_model(ModelSection(path=str(folder), init_value_head=False), for_training=False)
    ids, mask = padded_batch(seed=7)
    scores = sequence_scores(model, ids, mask)
    one_by_one = [sequence_scores(model, ids[i:i + 1, :n], mask[i:i + 1, :n]).item()
                  for i, n in enumerate(mask.sum(-1).tolist())]
    torch.testing.assert_close(scores, torch.tensor(one_by_one), atol=1e-5, rtol=1e-5)


def test_critic_from_a_saved_reward_model_keeps_its_head(causal_folders, tmp_path):
    reward = build_value_model(ModelSection(path=str(causal_folders["mistral"])))
    save_value_model(reward, tmp_path / "rm")
    critic = build_value_model(ModelSection(path=str(tmp_path / "rm")))
    assert torch.equal(critic.score.weight, reward.score.weight)


def test_a_critic_from_a_normalised_reward_model_starts_in_normalised_units(causal_folders, tmp_path):
    """PPO's critic starts from the reward model: with the normalisation folded into its head, its values at
    every position are (raw - mean) / std, and it saves as a model without normalisation."""
    reward = build_value_model(ModelSection(path=str(causal_folders["llama"])), for_training=False)
    set_reward_normalization(reward, mean=3.5, std=4.0)
    save_value_model(reward, tmp_path / "rm")
    ids, mask = padded_batch(seed=8)
    raw = token_values(reward, ids, mask)

    critic = build_value_model(ModelSection(path=str(tmp_path / "rm")), fold_normalization=True)
    critic.eval()
    torch.testing.assert_close(token_values(critic, ids, mask), torch.where(mask.bool(), (raw - 3.5) / 4.0, 0.0))
    assert reward_normalization(critic) == (0.0, 1.0)
    unfolded = build_value_model(ModelSection(path=str(tmp_path / "rm")))
    assert torch.equal(unfolded.score.weight, reward.score.weight)


def test_folding_gives_a_bias_less_head_a_bias(tmp_path):
    from transformers import AutoModelForSequenceClassification

    folder = make_model_folder(tmp_path / "seqcls", model_class=AutoModelForSequenceClassification, num_labels=1)
    model = build_value_model(ModelSection(path=str(folder), init_value_head=False), for_training=False)
    assert model.score.bias is None
    ids, mask = padded_batch(seed=9)
    raw = sequence_scores(model, ids, mask)
    set_reward_normalization(model, mean=-1.0, std=0.5)
    fold_reward_normalization(model)
    torch.testing.assert_close(sequence_scores(model, ids, mask), (raw + 1.0) / 0.5)
    fold_reward_normalization(model)  # (0, 1) now: nothing changes
    torch.testing.assert_close(sequence_scores(model, ids, mask), (raw + 1.0) / 0.5)


# ------------------------------------------------------------------------------------------------ errors
def test_causal_lm_without_init_value_head_is_an_error(causal_folders):
    folder = causal_folders["llama"]
    with pytest.raises(ModelFolderError, match=rf"'{folder}' is a causal LM without a value head.*"
                                               r"model.init_value_head=true"):
        build_value_model(ModelSection(path=str(folder), init_value_head=False))


def test_classifier_with_several_labels_is_an_error(tmp_path):
    from transformers import AutoModelForSequenceClassification

    folder = make_model_folder(tmp_path / "cls3", model_class=AutoModelForSequenceClassification, num_labels=3)
    with pytest.raises(ModelFolderError, match="with 3 labels; a reward/value model has exactly one"):
        build_value_model(ModelSection(path=str(folder)))


def test_encoder_folder_cannot_be_a_value_model(tmp_path):
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                         vocab_size=32)).save_pretrained(folder)
    with pytest.raises(ModelFolderError, match="holds a BertModel, which is neither a causal LM"):
        build_value_model(ModelSection(path=str(folder)))


def test_missing_value_model_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        build_value_model(ModelSection(path=str(tmp_path / "absent")))
