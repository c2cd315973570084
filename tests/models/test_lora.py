"""LoRA through peft: what trains, what a step changes, merged and adapter saves, QLoRA's refusal on CPU."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.config import ConfigError, LoraSection, ModelSection
from hpc_rlhf.models.builders import ModelFolderError, build_causal_lm, model_num_params
from hpc_rlhf.models.lora import (apply_lora, merge_and_unload_for_save, merged_state_dict, merged_tensors,
                                  quantization_config, save_model)
from hpc_rlhf.models.value_model import build_value_model, save_value_model, sequence_scores
from tests.models.conftest import make_model_folder, padded_batch

RANK = 4
TARGETS = ["q_proj", "v_proj"]


def lora_section(**overrides) -> ModelSection:
    return ModelSection(lora=LoraSection(rank=RANK, alpha=8.0, target_modules=TARGETS), **overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("lora") / "qwen2", "qwen2")


def train_step(model, ids, mask, loss_fn) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss_fn(model, ids, mask).backward()
    optimizer.step()
    optimizer.zero_grad()


def lm_loss(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def value_loss(model, ids, mask):
    return (sequence_scores(model, ids, mask) - 1.0).pow(2).mean()


def expected_lora_params(base) -> int:
    """r * (in + out) for every targeted linear layer of the plain model."""
    return sum(RANK * (m.in_features + m.out_features) for name, m in base.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS)


# -------------------------------------------------------------------------------------------- trainables
def test_causal_lm_lora_trains_only_the_adapters(folder):
    from transformers import AutoModelForCausalLM

    model = build_causal_lm(lora_section(path=str(folder)))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert model_num_params(model, trainable_only=True) == expected_lora_params(plain)

    ids, mask = padded_batch(seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, ids, mask, lm_loss)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    # lora_B starts at zero, so the first step moves only B (A's gradient is proportional to B).
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)


def test_value_model_lora_keeps_the_head_trainable(folder):
    from transformers import AutoModelForCausalLM

    model = build_value_model(lora_section(path=str(folder)))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    head = {n for n in trainable if ".score." in n}
    assert head == {"base_model.model.score.modules_to_save.default.weight",
                    "base_model.model.score.modules_to_save.default.bias"}
    assert all(".lora_" in n for n in trainable - head)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert model_num_params(model, trainable_only=True) == expected_lora_params(plain) + 32 + 1

    ids, mask = padded_batch(seed=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, ids, mask, value_loss)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert head <= changed <= trainable


def test_lora_with_gradient_checkpointing_backpropagates(folder):
    model = build_causal_lm(lora_section(path=str(folder), gradient_checkpointing=True))
    ids, mask = padded_batch(seed=3)
    lm_loss(model, ids, mask).backward()
    grads = [p.grad for n, p in model.named_parameters() if ".lora_B." in n]
    assert grads and all(g is not None and torch.count_nonzero(g) > 0 for g in grads)


def test_inference_build_ignores_lora(folder):
    model = build_causal_lm(lora_section(path=str(folder)), for_training=False)
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_unknown_target_modules_list_the_real_ones(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ConfigError, match=r"target_modules=\['query'\] matches no layer .*q_proj"):
        apply_lora(model, LoraSection(rank=2, target_modules=["query"]))


def test_target_modules_the_model_lacks_are_named_even_when_others_exist(folder):
    """peft itself refuses only a list of which no name matches; one wrong name among right ones would leave
    layers untrained without a word."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules=\['q_proj', 'qkv'\]: \['qkv'\] matches no layer "
                                          r"of Qwen2ForCausalLM; its linear layers are: down_proj, .*v_proj$"):
        apply_lora(model, LoraSection(rank=2, target_modules=["q_proj", "qkv"]), where="actor.lora")


def test_rank_zero_is_not_lora(folder):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ConfigError, match="rank > 0"):
        apply_lora(AutoModelForCausalLM.from_pretrained(folder), LoraSection(rank=0))


# ------------------------------------------------------------------------------------------------ saving
@pytest.fixture
def trained_lm(folder):
    model = build_causal_lm(lora_section(path=str(folder)))
    ids, mask = padded_batch(seed=4)
    for _ in range(2):  # two steps, so that both lora_A and lora_B have moved
        train_step(model, ids, mask, lm_loss)
    model.eval()
    return model, ids, mask


def test_merged_save_loads_in_plain_transformers_with_equal_logits(trained_lm, tmp_path):
    from transformers import AutoModelForCausalLM

    model, ids, mask = trained_lm
    adapted = model(input_ids=ids, attention_mask=mask).logits.detach()
    save_model(model, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask).logits, adapted, atol=1e-5, rtol=1e-5)
    # The adapters are folded into a copy: the training model still has them, unchanged.
    assert type(model).__name__ == "PeftModelForCausalLM"
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, adapted, atol=0, rtol=0)
    # And the adapters did change the model, or this test would prove nothing.
    base = AutoModelForCausalLM.from_pretrained(model.peft_config["default"].base_model_name_or_path).eval()
    assert not torch.allclose(base(input_ids=ids, attention_mask=mask).logits, adapted, atol=1e-4)


def test_merged_state_dict_has_the_plain_model_names(trained_lm, folder):
    from transformers import AutoModelForCausalLM

    model, _, _ = trained_lm
    state = merged_state_dict(model)
    plain = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(state) == set(plain)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in plain.items()}
    # Hand check of one merged weight: W + B @ A * alpha / r.
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    expected = q.base_layer.weight + q.lora_B["default"].weight @ q.lora_A["default"].weight * (8.0 / RANK)
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"], expected)


def test_merged_tensors_gather_one_module_or_one_adapter_layer_at_a_time(trained_lm):
    """The weight stream (weight sync, saving under ZeRO-3) asks for one unit at a time: a module's own
    parameters, or a whole LoRA layer (base weight and adapters, which its merged weight needs). Every tensor is
    yielded while its unit is gathered, and nothing else is gathered then."""
    import contextlib

    model, _, _ = trained_lm
    gathered: set[int] = set()
    units = []

    @contextlib.contextmanager
    def gather(params):
        units.append({id(p) for p in params})
        gathered.update(units[-1])
        try:
            yield
        finally:
            gathered.difference_update(units[-1])

    owners = {id(p): name for name, p in model.named_parameters()}
    streamed = {}
    for name, tensor in merged_tensors(model, gather=gather):
        streamed[name] = tensor.detach().clone()
        assert gathered == units[-1], name  # exactly the current unit
    assert streamed.keys() == merged_state_dict(model).keys()
    assert all(torch.equal(streamed[k], v) for k, v in merged_state_dict(model).items())
    lora_units = [u for u in units if any(".lora_A." in owners[i] for i in u)]
    assert len(lora_units) == 2 * len(model.get_base_model().model.layers)  # q_proj and v_proj of each layer
    for unit in lora_units:  # base weight (and bias: qwen2's q/v have one), A and B of one layer
        kinds = sorted(owners[i].split(".")[-2] if "lora_" in owners[i] else owners[i].rsplit(".", 1)[-1]
                       for i in unit)
        assert kinds == ["bias", "default", "default", "weight"], kinds
    # other ranks of a ZeRO-3 group take part in the same gathers without computing anything
    count = len(units)
    assert list(merged_tensors(model, gather=gather, emit=False)) == [] and len(units) == 2 * count


def test_adapter_save_writes_an_adapter_folder(trained_lm, tmp_path):
    model, _, _ = trained_lm
    save_model(model, tmp_path / "adapter", merge=False)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "config.json").exists()
    with pytest.raises(ModelFolderError, match="holds only a LoRA adapter"):
        build_causal_lm(ModelSection(path=str(tmp_path / "adapter")))


def test_merge_and_unload_gives_a_plain_model_with_equal_logits(trained_lm):
    model, ids, mask = trained_lm
    adapted = model(input_ids=ids, attention_mask=mask).logits.detach()
    plain = merge_and_unload_for_save(model)
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask).logits, adapted, atol=1e-5, rtol=1e-5)


def test_merged_value_model_reloads_with_equal_scores(folder, tmp_path):
    model = build_value_model(lora_section(path=str(folder)))
    ids, mask = padded_batch(seed=5)
    for _ in range(2):
        train_step(model, ids, mask, value_loss)
    model.eval()
    scores = sequence_scores(model, ids, mask).detach()
    save_value_model(model, tmp_path / "rm", merge_lora=True)
    loaded = build_value_model(ModelSection(path=str(tmp_path / "rm"), init_value_head=False), for_training=False)
    torch.testing.assert_close(sequence_scores(loaded, ids, mask), scores, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- QLoRA
def test_qlora_without_a_gpu_says_why(folder):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(ConfigError, match="load_in_4bit=true \\(QLoRA\\) needs a CUDA GPU"):
        quantization_config(LoraSection(rank=4, load_in_4bit=True))
    cfg = lora_section(path=str(folder))
    cfg.lora.load_in_4bit = True
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        build_causal_lm(cfg)


def test_qlora_needs_adapters():
    with pytest.raises(ConfigError, match="load_in_4bit=true needs model.lora.rank > 0"):
        quantization_config(LoraSection(rank=0, load_in_4bit=True))


def test_no_qlora_no_quantization():
    assert quantization_config(LoraSection(rank=4)) is None


# ------------------------------------------------------------------------------------- the adapter alone (issue 27)
def test_adapter_tensors_are_peft_s_own_adapter_file(trained_lm, tmp_path):
    """What LoRA RL syncs is exactly what peft writes as the adapter: the same names, the same values; the base
    weights are not part of it."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from hpc_rlhf.models.lora import adapter_parameters, adapter_tensors

    model, _, _ = trained_lm
    streamed = dict(adapter_tensors(model))
    expected = get_peft_model_state_dict(model)
    assert streamed.keys() == expected.keys()
    assert all(torch.equal(streamed[k], expected[k]) for k in expected)
    save_model(model, tmp_path / "adapter", merge=False)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == streamed.keys()
    assert sum(t.numel() for t in streamed.values()) == model_num_params(model, trainable_only=True)
    params = adapter_parameters(model)  # where a receiving copy loads them: the live parameters
    assert params.keys() == streamed.keys() and all(params[k] is not streamed[k] for k in params)
    assert all(torch.equal(params[k], streamed[k]) for k in params)


def test_adapter_tensors_gather_one_lora_layer_at_a_time(trained_lm):
    import contextlib

    from hpc_rlhf.models.lora import adapter_tensors

    model, _, _ = trained_lm
    units = []

    @contextlib.contextmanager
    def gather(params):
        units.append(len(params))
        yield

    names = [name for name, _ in adapter_tensors(model, gather=gather)]
    assert units == [2] * (2 * len(model.get_base_model().model.layers))  # A and B of q_proj, v_proj per layer
    assert len(names) == sum(units)
    count = len(units)  # the other ranks of a ZeRO-3 group: the same gathers, nothing yielded
    assert list(adapter_tensors(model, gather=gather, emit=False)) == [] and len(units) == 2 * count


def test_an_adapter_folder_written_from_the_stream_loads_in_peft_with_equal_logits(trained_lm, folder, tmp_path):
    """The folder a vLLM engine is handed (one per sync) is a plain PEFT adapter folder over the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.lora import adapter_tensors, write_adapter_folder

    model, ids, mask = trained_lm
    lora = LoraSection(rank=RANK, alpha=8.0, target_modules=TARGETS)
    write_adapter_folder(tmp_path / "v1", dict(adapter_tensors(model)), lora, str(folder))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "v1").eval()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                               model(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)


def test_the_actor_with_its_adapter_off_is_the_reference_built_from_the_same_base(trained_lm, folder):
    """ref_mode=adapter_disabled: the actor's own module with its adapter off gives the log-probs of a separate
    reference model loaded from the same base folder (1e-6; fp32 on CPU they are equal bit for bit), and the
    adapter is back on afterwards."""
    from hpc_rlhf.algorithms.logprobs import token_logprobs
    from hpc_rlhf.models.lora import adapter_disabled

    model, ids, mask = trained_lm
    reference = build_causal_lm(lora_section(path=str(folder)), for_training=False)

    def logps(m):  # of every next token at temperature 0.7, as the RL step scores them
        with torch.no_grad():
            logits = m(input_ids=ids, attention_mask=mask).logits.float() / 0.7
        return token_logprobs(logits[:, :-1], ids[:, 1:]) * mask[:, 1:]

    adapted = logps(model)
    with adapter_disabled(model):
        off = logps(model)
    torch.testing.assert_close(off, logps(reference), atol=1e-6, rtol=0)
    assert (off - adapted).abs().max() > 1e-3  # the adapter matters: off is not the actor
    torch.testing.assert_close(logps(model), adapted, atol=0, rtol=0)
