"""Dropout off in the RL roles' models.

PPO's ratio pi / pi_old must be 1 on the first mini-batch: old log-probs and values are computed without
gradient, then the same samples are trained on. With dropout active in training only, the two passes see
different networks and the ratio starts away from 1 (clipping, bias). A checkpoint fine-tuned with dropout (or
a LoRA adapter with `lora_dropout`) keeps it in its config, so the RL recipe turns it off in every trained
role, as other RLHF systems do.
"""

from __future__ import annotations

import torch


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability in `model` to 0; returns how many places held a non-zero one.

    Covers `nn.Dropout` modules (MLP, embedding and LoRA dropout) and the float `attention_dropout` that
    attention modules copy from the config at construction and pass to the attention kernel in train mode.
    The model's config is left as it was, so a saved model keeps the dropout it was given.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            module.attention_dropout = 0.0
            changed += 1
    return changed
