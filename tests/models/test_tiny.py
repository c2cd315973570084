import filecmp
import json
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.models import tiny


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.load_tokenizer()


PRINTABLE = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=PRINTABLE, max_size=80))
def test_decode_gives_back_any_printable_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    if not any(special in text for special in tiny.SPECIAL_TOKENS):  # "<eos>" typed out is one token
        assert len(ids) == len(text) + 1  # one token per character, plus <bos>
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=50, deadline=None)
@given(parts=st.lists(st.sampled_from(["<eos>", "<|user|>", "<pad>", "a", "<", ">", "|", " "]), max_size=12))
def test_special_token_texts_round_trip(tokenizer, parts):
    text = "".join(parts)
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_special_token_ids(tokenizer):
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", 0)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<bos>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<eos>", 2)
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<unk>", 3)
    assert tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [4, 5, 6]
    assert len(tokenizer) == 7 + len(tiny.CHARACTERS) == 104
    # <eos> is never appended by the tokenizer itself; written as text it is the single special token.
    assert tokenizer("7+5=12")["input_ids"][-1] != tokenizer.eos_token_id
    assert tokenizer("12<eos>", add_special_tokens=False)["input_ids"] == [
        tokenizer.convert_tokens_to_ids("1"), tokenizer.convert_tokens_to_ids("2"), 2]
    # A character outside the alphabet becomes <unk> rather than vanishing.
    assert tokenizer("aé", add_special_tokens=False)["input_ids"][1] == tokenizer.unk_token_id


def test_padding_uses_pad_id(tokenizer):
    batch = tokenizer(["1+1=", "10+10="], padding=True, padding_side="left")
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]


def test_chat_template(tokenizer):
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "17+25="},
            {"role": "assistant", "content": "42"}, {"role": "user", "content": "1+2="}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<bos><|system|>Add.<eos><|user|>17+25=<eos><|assistant|>42<eos><|user|>1+2=<eos>")
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).endswith(
        "<|user|>1+2=<eos><|assistant|>")

    out = tokenizer.apply_chat_template(chat[1:3], return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[0] == tokenizer.bos_token_id  # from the template, not doubled by the tokenizer
    assert ids.count(tokenizer.bos_token_id) == 1
    # Only the assistant's content and its closing <eos> are marked as trained-on tokens.
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "42<eos>"

    with pytest.raises(Exception, match="chat role must be system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_committed_tokenizer_is_what_the_builder_makes(tmp_path):
    tiny.save_tokenizer(tiny.build_tokenizer(), tmp_path)
    committed = sorted(p.name for p in tiny.TOKENIZER_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == committed
    # Only JSON files, so the package data glob (models/tiny/*/*.json) ships the whole tokenizer.
    assert all(name.endswith(".json") for name in committed)
    for name in committed:
        assert filecmp.cmp(tmp_path / name, tiny.TOKENIZER_DIR / name, shallow=False), (
            f"{name} differs from the builder: run `python -m hpc_rlhf.models.tiny`")


EXPECTED = {  # name: (model class, layers, parameter range)
    "llama-tiny": ("LlamaForCausalLM", 2, (500_000, 600_000)),  # 2 layers: the learning tests' model, half the CPU
    "qwen2-tiny": ("Qwen2ForCausalLM", 4, (600_000, 1_200_000)),
    "mistral-tiny": ("MistralForCausalLM", 4, (600_000, 1_200_000)),
    "mixtral-tiny": ("MixtralForCausalLM", 4, (600_000, 1_300_000)),
}


@pytest.mark.parametrize("name", tiny.MODEL_NAMES)
def test_config_builds_a_model_of_the_intended_size(name, tokenizer):
    config = tiny.model_config(name)
    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    cls_name, layers, (low, high) = EXPECTED[name]
    assert (config.hidden_size, config.num_hidden_layers) == (128, layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 128
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == cls_name
    assert low <= model.num_parameters() <= high


def test_llama_tiny_shape_and_mixtral_experts():
    llama = tiny.model_config("llama-tiny")
    # ~1M parameters: the size DESIGN §7 measured learning with
    assert llama.intermediate_size == 512 and not llama.tie_word_embeddings
    mixtral = tiny.model_config("mixtral-tiny")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    # A Qwen2-style tied head keeps the shared-weight code paths (saving, weight sync) exercised.
    assert tiny.model_config("qwen2-tiny").tie_word_embeddings


def test_every_family_has_a_config_file():
    files = sorted(p.stem for p in tiny.TINY_DIR.glob("*.json"))
    assert files == sorted(tiny.MODEL_NAMES)
    for name in files:
        assert "model_type" in json.loads((tiny.TINY_DIR / f"{name}.json").read_text())


def test_unknown_model_name_is_named():
    with pytest.raises(ValueError, match="unknown tiny model 'llama-huge'.*llama-tiny"):
        tiny.model_config("llama-huge")


@pytest.mark.parametrize("name", tiny.MODEL_NAMES)
def test_model_folder_loads_and_generates(name, tmp_path):
    folder = tiny.make_model_folder(name, tmp_path / name, seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["1+2=", "33+44="], return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    assert torch.equal(out[:, :batch["input_ids"].shape[1]], batch["input_ids"])
    assert int(out.max()) < len(tokenizer)


def test_model_folder_is_deterministic_in_the_seed(tmp_path):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    first = tiny.make_model_folder("llama-tiny", tmp_path / "a", seed=7)
    # The caller's RNG stream is untouched by the seeded initialisation.
    assert torch.equal(torch.rand(3), before)
    second = tiny.make_model_folder("llama-tiny", tmp_path / "b", seed=7)
    other = tiny.make_model_folder("llama-tiny", tmp_path / "c", seed=8)
    for file in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(first / file, second / file, shallow=False), file
    a = AutoModelForCausalLM.from_pretrained(first).state_dict()
    c = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
