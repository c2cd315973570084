import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.models.dropout import disable_dropout


def _model_with_dropout() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config)
    model.model.embed_tokens = torch.nn.Sequential(model.model.embed_tokens, torch.nn.Dropout(0.3))
    return model


def test_train_mode_logits_equal_eval_mode_once_dropout_is_off():
    model = _model_with_dropout()
    ids = torch.randint(0, 32, (2, 6))
    model.train()
    torch.manual_seed(1)
    with torch.no_grad():
        noisy = model(input_ids=ids).logits
        reference = model.eval()(input_ids=ids).logits
    assert not torch.allclose(noisy, reference)  # the test model really has dropout
    assert disable_dropout(model) == 3  # two attention layers and the added nn.Dropout
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference)
    assert model.config.attention_dropout == 0.5  # the config (and so a saved model) keeps its setting
