"""The rollout interface every generation backend implements (DESIGN §5).

A rollout engine turns prompt token ids into sampled responses together with the log-probability of every
sampled token, accepts new weights by name, and can give its accelerator memory back while the training
engines run. Two implementations exist: `hf.HFRolloutEngine` (a transformers model in the rank's own process,
CPU and GPU) and `vllm.VLLMRolloutEngine` (vLLM in processes of its own: its CPU build on CPU, its CUDA build on
GPUs).

Log-probs reported by the engines are those of the sampling distribution: `log_softmax(logits / T)` at the
sampled token, with T = 1 for greedy decoding (temperature 0). That is the quantity a teacher-forced pass of the
same model at temperature T recomputes, which is what PPO's ratio needs. With top-k/top-p truncation the hf engine
still reports the value before truncation, vLLM the value renormalised over the kept tokens.

Names given to `load_weights` are those of the plain Hugging Face model (`model.layers.0.mlp.up_proj.weight`);
`hf_param_name` turns the names of a DeepSpeed- or peft-wrapped actor into those.

LoRA RL (`actor.lora.rank > 0`): an engine started with the actor's LoRA settings holds the frozen base weights,
loaded once from the actor's base folder, and takes the adapter alone at every sync (`load_adapter`); the hf engine
applies it to its own copy through peft, vLLM through its own LoRA support (a new adapter version per sync).
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Iterable, Iterator

import torch

FINISH_REASONS = ("stop", "length")


class RolloutError(ValueError):
    """Bad input to a rollout engine (prompts, sampling parameters, weights)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy decoding; top_k 0 and top_p 1 mean no truncation."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0, got {self.stop_token_ids}"),
        ]
        for ok, message in checks:
            if not ok:
                raise RolloutError(f"SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The T of the reported `log_softmax(logits / T)`: greedy decoding reports plain log-softmax."""
        return 1.0 if self.greedy else self.temperature


@dataclasses.dataclass
class RolloutBatch:
    """Responses indexed [prompt][sample]: token ids (int64), sampling log-probs (float32), finish reason.

    A response ends with its stop token when it stopped ("stop"), and has exactly max_new_tokens tokens when it
    did not ("length"); there is never padding. `flat_*` list the samples prompt-major (prompt i, sample j at
    i * n + j), the order the exchange sends them in.
    """
    prompt_ids: list[list[int]]
    responses: list[list[torch.Tensor]]
    logprobs: list[list[torch.Tensor]]
    finish_reasons: list[list[str]]

    def __post_init__(self):
        sizes = {len(self.prompt_ids), len(self.responses), len(self.logprobs), len(self.finish_reasons)}
        if len(sizes) != 1:
            raise RolloutError(f"RolloutBatch: prompt_ids, responses, logprobs and finish_reasons must have one "
                               f"entry per prompt, got lengths {len(self.prompt_ids)}, {len(self.responses)}, "
                               f"{len(self.logprobs)}, {len(self.finish_reasons)}")
        for i, (toks, lps, reasons) in enumerate(zip(self.responses, self.logprobs, self.finish_reasons)):
            if not len(toks) == len(lps) == len(reasons):
                raise RolloutError(f"RolloutBatch: prompt {i} has {len(toks)} responses, {len(lps)} log-prob "
                                   f"rows and {len(reasons)} finish reasons")
            for j, (t, lp, reason) in enumerate(zip(toks, lps, reasons)):
                if t.shape != lp.shape or t.dim() != 1:
                    raise RolloutError(f"RolloutBatch: prompt {i} sample {j}: tokens {tuple(t.shape)} and "
                                       f"log-probs {tuple(lp.shape)} must be 1-D and of equal length")
                if reason not in FINISH_REASONS:
                    raise RolloutError(f"RolloutBatch: prompt {i} sample {j}: finish reason {reason!r} is not "
                                       f"one of {FINISH_REASONS}")

    @property
    def num_prompts(self) -> int:
        return len(self.responses)

    def flat_responses(self) -> list[torch.Tensor]:
        return [t for per_prompt in self.responses for t in per_prompt]

    def flat_logprobs(self) -> list[torch.Tensor]:
        return [lp for per_prompt in self.logprobs for lp in per_prompt]

    def flat_finish_codes(self) -> torch.Tensor:
        """Finish reasons as int64 codes (index into FINISH_REASONS), so they travel as a tensor."""
        return torch.tensor([FINISH_REASONS.index(r) for per_prompt in self.finish_reasons for r in per_prompt],
                            dtype=torch.int64)

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(t) for t in self.flat_responses()], dtype=torch.int64)


class RolloutEngine(abc.ABC):
    """generate / load_weights / sleep / wake: what the PPO loop needs from a generation backend."""

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """n samples for every prompt; prompts are lists of token ids without padding."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model by Hugging Face parameter name; returns how many were loaded.

        May be called several times per update (once per received bucket). The tensors may be views into a
        buffer the caller reuses, so an engine copies them before returning.
        """

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """LoRA RL: copy adapter tensors (named as in PEFT's adapter file, `models.lora.adapter_tensors`) into the
        engine's adapter, over its unchanged base weights; returns how many were loaded. Called once per received
        bucket; every sync sends the whole adapter, and the engine generates with it from its next `generate`.
        Only engines started with a LoRA adapter (`lora=`) take adapters."""
        raise RolloutError(f"{type(self).__name__} was started without a LoRA adapter: it takes full weights "
                           "(load_weights), not adapters")

    @abc.abstractmethod
    def sleep(self) -> None:
        """Give accelerator memory (weights, KV cache) back while other roles train on the same devices."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Undo `sleep` before the next `generate` or `load_weights`."""


def check_prompts(prompt_ids: list[list[int]], vocab_size: int | None = None) -> None:
    """One clear error for the prompt lists every engine gets (empty prompt, negative or out-of-vocab id)."""
    if not isinstance(prompt_ids, (list, tuple)):
        raise RolloutError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids).__name__}")
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise RolloutError(f"prompt {i} is empty: every prompt needs at least one token")
        low, high = min(prompt), max(prompt)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            raise RolloutError(f"prompt {i} has token id {low if low < 0 else high} outside the vocabulary "
                               f"[0, {vocab_size})")


def cut_at_stop(tokens: torch.Tensor, stop_ids: Iterable[int], max_new_tokens: int) -> tuple[int, str]:
    """(length to keep, finish reason) of one generated row: up to and including the first stop token.

    A row without a stop token ran out of budget ("length"); anything after the first stop token is padding
    or, for engines that return it, tokens generated past the stop.
    """
    stops = torch.tensor(sorted(set(stop_ids)), dtype=tokens.dtype, device=tokens.device)
    hits = torch.isin(tokens, stops).nonzero()
    if len(hits):
        return int(hits[0]) + 1, "stop"
    return min(len(tokens), max_new_tokens), "length"


# Wrappers whose prefixes appear in front of the Hugging Face names: DeepSpeed's engine (`module.`),
# torch.compile (`_orig_mod.`), FSDP1 (`_fsdp_wrapped_module.`), peft (`base_model.model.`).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_model.model.")
_LORA_TENSOR = re.compile(r"\.(lora_[A-Za-z_]+|lora_magnitude_vector)(\.|$)")


def hf_param_name(name: str) -> str | None:
    """Name of an actor parameter in the plain Hugging Face model, or None for a LoRA adapter tensor.

    Only valid for peft models whose adapters are merged into the base weights (`merge_adapter()`), so that
    dropping `lora_A`/`lora_B` loses nothing; unmerged adapters are folded in by
    `hpc_rlhf.models.lora.merged_state_dict` instead.
    """
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    if _LORA_TENSOR.search(name) or ".original_module." in name:
        return None
    name = re.sub(r"\.base_layer(?=\.|$)", "", name)
    return re.sub(r"\.modules_to_save\.[^.]+(?=\.|$)", "", name)


def hf_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream of (Hugging Face name, tensor), LoRA adapter tensors dropped (see `hf_param_name`)."""
    for name, tensor in named:
        mapped = hf_param_name(name)
        if mapped is not None:
            yield mapped, tensor
