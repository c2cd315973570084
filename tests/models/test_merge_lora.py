"""hpc_rlhf/models/merge_lora.py (`hpc-rlhf merge-lora`): an adapter folder merged into its base computes as the
base with the adapter, for a causal LM and for a reward model (head and normalisation included); what cannot be
merged is refused by name and leaves nothing behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hpc_rlhf.config import ModelSection
from hpc_rlhf.models.builders import ModelFolderError, build_causal_lm
from hpc_rlhf.models.lora import REWARD_NORMALIZATION_FILE, save_model
from hpc_rlhf.models.merge_lora import main, merge
from hpc_rlhf.models.value_model import build_value_model, set_reward_normalization, token_values
from tests.models.conftest import padded_batch
from tests.models.test_lora import lm_loss, lora_section, train_step, value_loss

TINY_MODEL = "examples/tiny/assets/models/llama-tiny"


@pytest.fixture(scope="module")
def lm_adapter(tmp_path_factory):
    """A causal LM's adapter as a run with merge_on_save=false writes it, and the adapted model's logits."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)  # lora_A starts random
    model = build_causal_lm(lora_section(path=TINY_MODEL))
    ids, mask = padded_batch(seed=4)
    for _ in range(2):  # both lora_A and lora_B move
        train_step(model, ids, mask, lm_loss)
    model.eval()
    folder = tmp_path_factory.mktemp("merge") / "adapter"
    save_model(model, folder, tokenizer=AutoTokenizer.from_pretrained(TINY_MODEL), merge=False)
    with torch.no_grad():
        return folder, model(input_ids=ids, attention_mask=mask).logits, (ids, mask)


def test_a_merged_causal_lm_loads_alone_and_computes_as_base_plus_adapter(lm_adapter, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter, adapted, (ids, mask) = lm_adapter
    assert main([str(adapter), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        logits = merged(input_ids=ids, attention_mask=mask).logits
        base = AutoModelForCausalLM.from_pretrained(TINY_MODEL).eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(base, adapted, atol=1e-4)  # the adapter changed the model, or this proves nothing
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").get_vocab() == \
        AutoTokenizer.from_pretrained(TINY_MODEL).get_vocab()
    # the project's own loader takes it as model.path
    build_causal_lm(ModelSection(path=str(tmp_path / "merged")))


def test_the_dtype_is_the_bases_unless_asked(lm_adapter, tmp_path):
    from safetensors import safe_open

    adapter, _, _ = lm_adapter
    merge(adapter, tmp_path / "half", dtype="bfloat16")
    with safe_open(str(tmp_path / "half" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    base = tmp_path / "base16"  # a base stored in bfloat16: the merge is written in bfloat16 too
    shutil.copytree(TINY_MODEL, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    merge(adapter, tmp_path / "as_base", base=str(base))
    with safe_open(str(tmp_path / "as_base" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_low_memory_holds_a_bfloat16_base_as_bfloat16_and_merges_within_its_rounding(lm_adapter, tmp_path,
                                                                                        monkeypatch):
    """--low-memory on a base stored in bfloat16: the base is held in bfloat16 (half the bytes of float32), and
    each merged weight is the float32 merge's up to bfloat16's rounding of the adapter's product and of the sum."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models import merge_lora

    adapter, _, _ = lm_adapter
    base = tmp_path / "base16"
    AutoModelForCausalLM.from_pretrained(TINY_MODEL).to(torch.bfloat16).save_pretrained(base)
    held = []
    monkeypatch.setattr(merge_lora, "build_causal_lm",
                        lambda section, **kw: held.append(section.dtype) or build_causal_lm(section, **kw))
    assert main([str(adapter), str(tmp_path / "exact"), "--base", str(base)]) == 0
    assert main([str(adapter), str(tmp_path / "low"), "--base", str(base), "--low-memory"]) == 0
    assert held == ["float32", "bfloat16"]
    weights, exact, low = (load_file(str(folder / "model.safetensors")) for folder in (base, tmp_path / "exact",
                                                                                      tmp_path / "low"))
    assert exact.keys() == low.keys() == weights.keys()
    assert {t.dtype for t in low.values()} == {torch.bfloat16}
    moved = 0
    for name, w in weights.items():
        w, e, m = w.float(), exact[name].float(), low[name].float()
        delta = e - w
        moved += int((delta != 0).sum())
        assert bool(((m - e).abs() <= 2 ** -6 * (w.abs() + delta.abs())).all()), name
    assert moved > 0  # the adapter moved weights, or this compares the base with itself


def test_a_reward_models_adapter_merges_with_its_head_and_normalisation(tmp_path):
    """A LoRA reward model saved as an adapter keeps its normalisation beside it; the merged folder is a value
    model that scores as the adapted one and carries the constants in its config again."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)  # the head starts from a random initialisation
    model = build_value_model(lora_section(path=TINY_MODEL))
    ids, mask = padded_batch(seed=5)
    for _ in range(2):
        train_step(model, ids, mask, value_loss)
    model.eval()
    set_reward_normalization(model, 0.25, 2.0)
    with torch.no_grad():
        adapted = token_values(model, ids, mask)
    save_model(model, tmp_path / "rm_adapter", tokenizer=AutoTokenizer.from_pretrained(TINY_MODEL), merge=False)
    assert json.loads((tmp_path / "rm_adapter" / REWARD_NORMALIZATION_FILE).read_text()) == \
        {"reward_mean": 0.25, "reward_std": 2.0}
    merge(tmp_path / "rm_adapter", tmp_path / "rm")
    loaded = build_value_model(ModelSection(path=str(tmp_path / "rm"), init_value_head=False), for_training=False)
    with torch.no_grad():
        # values of about 25 after two steps of the value loss: fp32's rounding of a merged weight is ~1e-5 of them
        torch.testing.assert_close(token_values(loaded, ids, mask), adapted, atol=1e-5, rtol=1e-4)
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert (config["reward_mean"], config["reward_std"]) == (0.25, 2.0)

    (tmp_path / "rm_adapter" / REWARD_NORMALIZATION_FILE).write_text('{"reward_mean": 0.0, "reward_std": 0}')
    with pytest.raises(ModelFolderError, match=f"{REWARD_NORMALIZATION_FILE}' does not hold a usable"):
        merge(tmp_path / "rm_adapter", tmp_path / "rm2")
    assert not (tmp_path / "rm2").exists()


def test_what_cannot_be_merged_is_named_and_nothing_is_written(lm_adapter, tmp_path, capsys):
    adapter, _, _ = lm_adapter
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert main([str(adapter), str(existing)]) == 2
    assert "output folder" in capsys.readouterr().err and (existing / "keep.txt").read_text() == "mine"

    with pytest.raises(ModelFolderError, match="no adapter_config.json.*holds a whole model already"):
        merge(TINY_MODEL, tmp_path / "a")
    moved = tmp_path / "moved_adapter"  # its base named by a path that is not here
    shutil.copytree(adapter, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "gone/base"}))
    with pytest.raises(ModelFolderError, match="base model 'gone/base' named by .* does not exist here.*--base"):
        merge(moved, tmp_path / "b")
    (moved / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ModelFolderError, match="peft_type is 'PREFIX_TUNING'; only LoRA"):
        merge(moved, tmp_path / "c")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    # a base of four layers where the adapter has two: peft alone would only warn
    with pytest.raises(ModelFolderError, match="does not fit the base '.*qwen2-tiny': the base has 8 adapted tensors "
                                               "the adapter lacks"):
        merge(moved, tmp_path / "d", base="examples/tiny/assets/models/qwen2-tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "moved_adapter"]
