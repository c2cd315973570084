"""Writing a model as a Hugging Face folder from whichever rank the caller chose.

The lowest layer of hpc_rlhf/models: it imports nothing else of the project, so that the LoRA helpers
(lora.py), the model builders (builders.py) and the training engine can all save through it.
"""

from __future__ import annotations

from pathlib import Path


def save_pretrained_on_this_rank(model, directory: str | Path, **kwargs) -> None:
    """`model.save_pretrained(directory, **kwargs)` that writes from whichever rank calls it.

    transformers 5 writes weights only on global rank 0 whenever torch.distributed is initialised
    (`should_save_on_this_rank`), whatever `is_main_process` says; a role leader on another rank (the critic's,
    a reward model's) would silently write a folder without weights. The caller decides who saves.
    """
    had_own = "should_save_on_this_rank" in vars(model)
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(str(directory), **kwargs)
    finally:
        if not had_own:
            del model.should_save_on_this_rank
