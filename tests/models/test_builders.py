"""Causal-LM and tokenizer builders on tiny models of each supported family, and their folder errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpc_rlhf.config import ConfigError, ModelSection
from hpc_rlhf.models.builders import (ModelFolderError, build_causal_lm, check_attn_implementation,
                                      load_tokenizer, model_num_params, resolve_dtype)
from tests.models.conftest import FAMILIES, VOCAB, make_model_folder, padded_batch

def make_tokenizer_folder(folder: Path, with_pad: bool = True) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(ord("a") + i) for i in range(26)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokens = dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    if with_pad:
        tokens["pad_token"] = "<pad>"
    PreTrainedTokenizerFast(tokenizer_object=backend, **tokens).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: make_model_folder(root / family, family) for family in FAMILIES}


# ---------------------------------------------------------------------------------------------- building
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_trains_and_matches_its_folder(family, family_folders):
    from transformers import AutoModelForCausalLM

    model = build_causal_lm(ModelSection(path=str(family_folders[family])))
    assert model.training and model.config.use_cache is False
    assert all(p.dtype == torch.float32 for p in model.parameters())  # dtype auto on the CPU
    ids, mask = padded_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert out.logits.shape == (3, 9, VOCAB)
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    # Mixtral routes each token to 2 of 4 experts; with 21 tokens every expert is hit.
    assert no_grad == []
    reference = AutoModelForCausalLM.from_pretrained(family_folders[family])
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_inference_model_is_frozen_and_in_eval_mode(family_folders):
    model = build_causal_lm(ModelSection(path=str(family_folders["llama"])), for_training=False)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_sdpa_and_eager_give_equal_logits(family_folders):
    ids, mask = padded_batch(seed=1)
    logits = {}
    for kernel in ("sdpa", "eager"):
        model = build_causal_lm(ModelSection(path=str(family_folders["qwen2"]), attn_implementation=kernel),
                                for_training=False)
        assert model.config._attn_implementation == kernel
        logits[kernel] = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits["sdpa"][real], logits["eager"][real], atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(family_folders):
    ids, mask = padded_batch(seed=2)
    grads = {}
    for checkpointing in (False, True):
        cfg = ModelSection(path=str(family_folders["mistral"]), gradient_checkpointing=checkpointing)
        model = build_causal_lm(cfg)
        assert model.is_gradient_checkpointing is checkpointing  # transformers 5.19 (5.23: is_activation_checkpointing)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-6, rtol=1e-5)


def test_explicit_dtype_is_honoured(family_folders):
    model = build_causal_lm(ModelSection(path=str(family_folders["llama"]), dtype="bfloat16"), for_training=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ConfigError, match="model.dtype"):
        resolve_dtype("float8")


def test_flash_attention_without_flash_attn_says_how_to_fix():
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ConfigError, match=r"`flash-attn` extra.*FLASH_ATTN=1.*attn_implementation=sdpa"):
        check_attn_implementation("flash_attention_2")


def test_flash_attention_error_comes_before_loading(tmp_path):
    # The folder does not even exist: the kernel check must not be what reports it, nor come after a load.
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    folder = make_model_folder(tmp_path / "m")
    with pytest.raises(ConfigError, match="flash-attn"):
        build_causal_lm(ModelSection(path=str(folder), attn_implementation="flash_attention_2"))


def test_model_num_params():
    layer = torch.nn.Linear(3, 2)  # 6 weights + 2 biases
    assert model_num_params(layer) == 8
    layer.bias.requires_grad_(False)
    assert model_num_params(layer, trainable_only=True) == 6


# ---------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_with_pad_token(tmp_path):
    tokenizer = load_tokenizer(make_tokenizer_folder(tmp_path / "tok"))
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id == 0
    assert tokenizer("abc")["input_ids"][-3:] == [4, 5, 6]


def test_tokenizer_without_pad_token_is_an_error_naming_the_folder(tmp_path):
    folder = make_tokenizer_folder(tmp_path / "nopad", with_pad=False)
    with pytest.raises(ModelFolderError, match=rf"'{folder}' has no pad token.*pad_to_eos"):
        load_tokenizer(folder)


def test_tokenizer_pads_with_eos_when_asked_and_warns(tmp_path, caplog):
    folder = make_tokenizer_folder(tmp_path / "nopad", with_pad=False)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.models.builders"):
        tokenizer = load_tokenizer(folder, pad_to_eos=True)
    assert tokenizer.pad_token == "<eos>" and tokenizer.pad_token_id == 2
    assert any("no pad token" in r.getMessage() for r in caplog.records)


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="tokenizer folder .* does not exist"):
        load_tokenizer(tmp_path / "absent")


# -------------------------------------------------------------------------------------------- bad folders
def build_from(path) -> None:
    build_causal_lm(ModelSection(path=str(path)))


def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match=rf"'{tmp_path / 'absent'}' does not exist"):
        build_from(tmp_path / "absent")


def test_path_is_a_file(tmp_path):
    (tmp_path / "model.bin").write_text("x")
    with pytest.raises(ModelFolderError, match="is a file"):
        build_from(tmp_path / "model.bin")


def test_folder_without_config(tmp_path):
    folder = make_model_folder(tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelFolderError, match=rf"'{folder}' has no config.json"):
        build_from(folder)


def test_adapter_only_folder_names_its_base(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base-7b"}))
    with pytest.raises(ModelFolderError, match=r"only a LoRA adapter \(base model: /models/base-7b\)"):
        build_from(folder)


def test_folder_without_weights(tmp_path):
    folder = make_model_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match=rf"'{folder}' has a config.json but no weights"):
        build_from(folder)


def test_unreadable_config(tmp_path):
    folder = make_model_folder(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="config.json cannot be read"):
        build_from(folder)


def test_value_model_folder_is_not_a_causal_lm(tmp_path):
    from transformers import AutoModelForTokenClassification

    folder = make_model_folder(tmp_path / "rm", model_class=AutoModelForTokenClassification, num_labels=1)
    with pytest.raises(ModelFolderError, match=r"LlamaForTokenClassification, which is not a causal language "
                                               r"model \(it is a reward/value model"):
        build_from(folder)


def test_encoder_folder_is_not_a_causal_lm(tmp_path):
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                         vocab_size=32)).save_pretrained(folder)
    with pytest.raises(ModelFolderError, match="holds a BertModel, which is not a causal language model"):
        build_from(folder)


def test_weights_of_another_size(tmp_path):
    folder = make_model_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"6 weight tensors do not match config.json \(.*mlp"):
        build_from(folder)


def test_weights_lacking_tensors(tmp_path):
    folder = make_model_folder(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.q_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"lack 1 tensors .*layers.1.self_attn.q_proj.weight"):
        build_from(folder)


def test_save_from_a_rank_other_than_zero_writes_the_weights(tmp_path, monkeypatch):
    """transformers 5 saves weights only on global rank 0 of an initialised world; a role leader elsewhere
    (critic, reward models) must still write them."""
    import transformers.distributed.mixin as mixin
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.models.saving import save_pretrained_on_this_rank

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=32))
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "model.safetensors").exists()  # the hazard this helper exists for
    save_pretrained_on_this_rank(model, tmp_path / "ours")
    assert (tmp_path / "ours" / "model.safetensors").is_file() and (tmp_path / "ours" / "config.json").is_file()
    assert "should_save_on_this_rank" not in vars(model)


def test_a_teacher_must_share_the_students_tokenizer(tmp_path):
    """On-policy distillation scores the student's token ids under the teacher: a teacher whose tokenizer maps a
    token to another id is refused, naming both folders and the token."""
    import shutil

    from hpc_rlhf.config import TINY_ASSETS
    from hpc_rlhf.models.builders import same_tokenizer_problem

    student = Path(TINY_ASSETS) / "models" / "llama-tiny"
    assert same_tokenizer_problem(student, student) is None
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(student / name, teacher / name)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # two digits swapped: same size, other ids
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    problem = same_tokenizer_problem(student, teacher)
    assert problem.startswith(f"distill.teacher '{teacher}' does not share the tokenizer of actor.path '{student}'")
    assert "2 mapped differently ('0': 7 vs 8, '1': 8 vs 7)" in problem


def test_tokenizer_files_that_are_the_same_bytes_are_the_same_tokenizer(tmp_path):
    """The preflight's check of a reward model's tokenizer without transformers: identical files say "the same";
    anything else (other bytes, a file on one side only, no tokenizer at all) says nothing."""
    import shutil

    from hpc_rlhf.config import TINY_ASSETS
    from hpc_rlhf.models.folders import same_tokenizer_files

    model = Path(TINY_ASSETS) / "models" / "llama-tiny"
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert same_tokenizer_files(model, copy)
    (copy / "special_tokens_map.json").write_text("{}")  # on one side only
    assert not same_tokenizer_files(model, copy)
    (copy / "special_tokens_map.json").unlink()
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["model"]["vocab"]["0"], spec["model"]["vocab"]["1"] = spec["model"]["vocab"]["1"], spec["model"]["vocab"]["0"]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    assert not same_tokenizer_files(model, copy)
    (tmp_path / "empty").mkdir()
    assert not same_tokenizer_files(tmp_path / "empty", tmp_path / "empty")  # no tokenizer: not "the same"
