"""Rollout with a transformers causal LM in this process (KV cache, batched, left padding): the CPU engine, also
usable on GPU.

Two decode loops give the same sampling distribution (tests/engines/test_rollout_hf.py checks it with a chi-square
test over thousands of samples):
- `lean` (the default): the prompts are prefilled once, the KV cache is then repeated for the n samples of each
  prompt, and each step is one forward pass, one log-softmax and one draw for the whole batch. GRPO draws 4-16
  samples of a prompt, so the prefill, the largest pass of a short rollout, is paid once instead of n times.
- `generate`: transformers' `generate` with `num_return_sequences=n` (prompts copied n times before the prefill,
  each token through its logits processors and stopping criteria). Kept as the reference the lean loop is tested
  against and for models whose forward the lean loop cannot drive.
Both draw each token with one `torch.multinomial` over the batch's probabilities, as `generate` does.

Log-probs: for every sampled token, `log_softmax(logits / T)` over the whole vocabulary, taken from the same
forward pass that produced the token (T = the sampling temperature, 1 for greedy). Top-k/top-p truncation
decides which token is drawn but does not renormalise the reported value, so it equals what a teacher-forced
pass of the same weights at temperature T computes (see `hpc_rlhf.engines.rollout.base`).

How (`generate` loop): one logits processor, `_SamplingProcessor`, does the sampling transform itself (temperature,
then transformers' own top-k and top-p warpers) and remembers the step's log-softmax; on its next call the token
just sampled is the last column of `input_ids`, so only one vocabulary-sized row per sequence is ever kept (asking
`generate` for `output_logits` would keep all of them: steps x batch x vocab floats). transformers runs user
processors before its own warpers, so `generate` is given neutral warper settings (temperature 1, top_k 0, top_p 1)
and every other processor a model's `generation_config` could switch on is set to its neutral value.

`synced_gpus=False` on every call by default: under ZeRO-3 transformers would otherwise all-reduce over the whole
world at every step, and a role that generates alone would hang (DESIGN §9).

A ZeRO-3 actor used in place (hybrid rollout, `sync_group=` the actor's group): generation runs through the module's
forward, so ZeRO-3's hooks gather one module at a time and no rank ever holds the whole model. Each forward pass is
then a collective of the group, so every rank must run as many as the others: the ranks agree on the number of
chunks (a rank with fewer prompts, or none, runs one-prompt chunks whose results it drops), and inside a chunk a
finished rank keeps stepping until every rank is done (an "all finished?" all-reduce in `sync_group` at every step:
the lean loop's own, or transformers' `synced_gpus` kept in the group). The price is traffic, not memory: each new
token gathers every layer again (a whole model's worth of all-gather per decoding step), which is slow for large
models; the vllm backend holds its own copy of the weights instead. `full_params=` (a context manager factory around
the whole call) remains for callers that want the parameters gathered at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from typing import Callable, ContextManager, Iterable

import inspect

import torch
import torch.distributed as dist
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, TopKLogitsWarper,
                          TopPLogitsWarper)

from hpc_rlhf.engines.rollout.base import (RolloutBatch, RolloutEngine, RolloutError, SamplingParams,
                                           check_prompts, cut_at_stop)
from hpc_rlhf.models.lora import adapter_parameters, is_peft_model

# Values that switch off every processor a checkpoint's generation_config.json could turn on: generate() fills
# unset (None) fields from the model's config, so "off" has to be said explicitly.
_NEUTRAL_GENERATION = dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                           repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                           min_new_tokens=0, num_beams=1, renormalize_logits=False,
                           remove_invalid_values=False)


def _truncation(sampling: SamplingParams) -> list[LogitsProcessor]:
    """transformers' own top-k and top-p warpers, as `generate` would apply them (none when switched off)."""
    warpers = []
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    return warpers


class _SamplingProcessor(LogitsProcessor):
    """Temperature + top-k + top-p, recording log_softmax(logits / T) of each sampled token."""

    def __init__(self, sampling: SamplingParams):
        self.temperature = sampling.logprob_temperature
        self.warpers = _truncation(sampling)
        self.pending: torch.Tensor | None = None  # log-softmax rows of the step whose token is not yet known
        self.picked: list[torch.Tensor] = []      # one [rows] tensor per decoded step

    def _take_pending(self, sampled: torch.Tensor) -> None:
        self.picked.append(self.pending.gather(1, sampled[:, None]).squeeze(1))
        self.pending = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self._take_pending(input_ids[:, -1])
        scaled = scores.float() / self.temperature
        self.pending = torch.log_softmax(scaled, dim=-1)
        for warper in self.warpers:
            scaled = warper(input_ids, scaled)
        return scaled

    def step_logprobs(self, sequences: torch.Tensor, num_new: int) -> torch.Tensor:
        """[rows, num_new] log-probs of the generated columns (generate may have run and undone extra steps)."""
        if len(self.picked) < num_new:
            self._take_pending(sequences[:, -1])
        if num_new == 0:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.picked[:num_new], dim=1)


class _Sampler:
    """One decoding step of the lean loop: log_softmax(logits / T) for the report, then top-k/top-p and one draw
    for the whole batch (argmax when greedy), as transformers' sampling does it."""

    def __init__(self, sampling: SamplingParams):
        self.greedy = sampling.greedy
        self.temperature = sampling.logprob_temperature
        self.warpers = _truncation(sampling)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = logits / self.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        for warper in self.warpers:
            scaled = warper(None, scaled)
        if self.greedy:
            return torch.argmax(scaled, dim=-1), logprobs
        return torch.multinomial(torch.softmax(scaled, dim=-1), num_samples=1).squeeze(1), logprobs


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs through
    return "logits_to_keep" in inspect.signature(base.forward).parameters


DECODE_LOOPS = ("lean", "generate")


class HFRolloutEngine(RolloutEngine):
    """Generation with a transformers causal LM that lives in this process.

    max_batch_prompts bounds how many prompts share one decoding batch (each expands to n rows); it caps
    KV-cache memory. Results do not depend on it for greedy decoding; sampled results depend on it through
    the random stream. `decode_loop`: "lean" or "generate" (the module docstring compares them).
    """

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int, *, max_batch_prompts: int = 64,
                 full_params: Callable[[], ContextManager] | None = None, sync_group=None,
                 decode_loop: str = "lean"):
        if max_batch_prompts < 1:
            raise RolloutError(f"max_batch_prompts must be >= 1, got {max_batch_prompts}")
        if decode_loop not in DECODE_LOOPS:
            raise RolloutError(f"decode_loop must be one of {DECODE_LOOPS}, got {decode_loop!r}")
        self.decode_loop = decode_loop
        self.model = model
        self.pad_id = int(pad_id)
        # Always given: with no eos of ours, generate() would stop at the checkpoint's own eos behind our back.
        self.eos_id = int(eos_id)
        self.max_batch_prompts = max_batch_prompts
        self.full_params = full_params or contextlib.nullcontext
        self.sync_group = sync_group  # ranks that run every forward pass together (see the module docstring)
        self._home_device: torch.device | None = None  # where the weights go back to on wake()
        # The receive buffers the weights live in once a sync has handed them over (`adopt_weights`,
        # hpc_rlhf.dist.weight_sync.receive_into): kept so that the next sync rewrites them in place.
        self.received_buffers: list[torch.Tensor] = []
        self._adapter: dict[str, torch.Tensor] | None = None  # LoRA RL: the adapter's parameters by file name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        return [self.eos_id] + [t for t in sampling.stop_token_ids if t != self.eos_id]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams, stop_ids: list[int]):
        """[rows, steps] new tokens (pad after a row's stop) and their log-probs, rows prompt-major."""
        if self.decode_loop == "lean":
            return self._lean_chunk(prompts, sampling, stop_ids)
        return self._generate_call_chunk(prompts, sampling, stop_ids)

    def _forward(self, input_ids, attention_mask, position_ids, cache, last_only: bool):
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=cache, use_cache=True)
        if last_only and _takes_logits_to_keep(self.model):
            kwargs["logits_to_keep"] = 1  # the prefill's other positions are never sampled from
        return self.model(**kwargs).logits[:, -1].float()

    def _lean_chunk(self, prompts: list[list[int]], sampling: SamplingParams, stop_ids: list[int]):
        input_ids, attention_mask = self._left_pad(prompts)
        # Positions as transformers' generate gives them: counted over the real tokens, 0 on the left padding.
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        cache = DynamicCache(config=getattr(self.model, "config", None))
        logits = self._forward(input_ids, attention_mask, position_ids, cache, last_only=True)
        n = sampling.n
        if n > 1:  # the n samples of a prompt share its prefill: the cache is repeated, not recomputed
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attention_mask = attention_mask.repeat_interleave(n, dim=0)
            position_ids = position_ids.repeat_interleave(n, dim=0)
        rows = logits.shape[0]
        position = position_ids[:, -1:]
        pick = _Sampler(sampling)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=logits.device)
        pad = torch.full((rows,), self.pad_id, dtype=torch.long, device=logits.device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=logits.device)
        tokens, logprobs = [], []
        new_mask_column = torch.ones((rows, 1), dtype=attention_mask.dtype, device=attention_mask.device)
        for step in range(sampling.max_new_tokens):
            if logits is not None:
                token, logprob = pick(logits)
                token = torch.where(unfinished, token, pad)  # a finished row only pads, as in generate
                tokens.append(token)
                logprobs.append(logprob.gather(1, token[:, None]).squeeze(1))
                unfinished &= ~torch.isin(token, stops)
                done_here = not bool(unfinished.any())
            if step == sampling.max_new_tokens - 1 or self._every_rank_done(done_here):
                break
            attention_mask = torch.cat([attention_mask, new_mask_column], dim=1)
            position = position + 1
            step_logits = self._forward(tokens[-1][:, None], attention_mask, position, cache, last_only=False)
            # A rank already done keeps stepping with its peers (ZeRO-3: each forward is a collective); its
            # rows sample nothing more.
            logits = None if done_here else step_logits
        if not tokens:
            return torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, 0)
        return torch.stack(tokens, dim=1).cpu(), torch.stack(logprobs, dim=1).float().cpu()

    def _every_rank_done(self, done_here: bool) -> bool:
        if self.sync_group is None:
            return done_here
        flag = torch.tensor([0 if done_here else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.sync_group)
        return int(flag.item()) == 0

    def _generate_call_chunk(self, prompts: list[list[int]], sampling: SamplingParams, stop_ids: list[int]):
        input_ids, attention_mask = self._left_pad(prompts)
        processor = _SamplingProcessor(sampling)
        neutral = dict(_NEUTRAL_GENERATION)
        if sampling.greedy:  # warpers are not applied without sampling, and transformers warns if they are set
            for key in ("temperature", "top_k", "top_p"):
                neutral.pop(key)
        config = GenerationConfig(**{**neutral,
                                     "do_sample": not sampling.greedy,
                                     "max_new_tokens": sampling.max_new_tokens,
                                     "num_return_sequences": sampling.n,
                                     "eos_token_id": stop_ids,
                                     "pad_token_id": self.pad_id,
                                     "use_cache": True,
                                     "return_dict_in_generate": False})
        sequences = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                        generation_config=config, logits_processor=LogitsProcessorList([processor]),
                                        synced_gpus=self.sync_group is not None)
        new_tokens = sequences[:, input_ids.shape[1]:]
        logprobs = processor.step_logprobs(sequences, new_tokens.shape[1])
        return new_tokens.cpu(), logprobs.float().cpu()

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        check_prompts(prompt_ids, getattr(getattr(self.model, "config", None), "vocab_size", None))
        if self._home_device is not None:
            raise RolloutError("generate() on a sleeping engine (weights moved to host memory); call wake() first")
        if sampling.greedy and sampling.n > 1:
            raise RolloutError(f"greedy decoding (temperature 0) gives n={sampling.n} identical samples; "
                               "use n=1 or a temperature > 0")
        stop_ids = self._stop_ids(sampling)
        was_training = self.model.training
        self.model.eval()
        # A seeded call must not move the caller's random stream, so it runs on a forked generator state.
        cuda_ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        rng = torch.random.fork_rng(devices=cuda_ids) if sampling.seed is not None else contextlib.nullcontext()
        responses, logprobs, reasons = [], [], []
        starts = range(0, len(prompt_ids), self.max_batch_prompts)
        chunks = self._chunks_of_every_rank(len(starts))  # agreed before any forward pass
        try:
            with rng, self.full_params(), _peers_agree_in(self.sync_group):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for start in starts:
                    chunk = prompt_ids[start:start + self.max_batch_prompts]
                    tokens, lps = self._generate_chunk(chunk, sampling, stop_ids)
                    for i in range(len(chunk)):
                        rows = range(i * sampling.n, (i + 1) * sampling.n)
                        kept = [cut_at_stop(tokens[r], stop_ids, sampling.max_new_tokens) for r in rows]
                        responses.append([tokens[r, :k].clone() for r, (k, _) in zip(rows, kept)])
                        logprobs.append([lps[r, :k].clone() for r, (k, _) in zip(rows, kept)])
                        reasons.append([reason for _, reason in kept])
                for _ in range(chunks - len(starts)):
                    # every rank of sync_group runs as many chunks (after its own: its samples stay as they
                    # were); the results of the extra ones are dropped
                    self._generate_chunk([[self.eos_id]], dataclasses.replace(sampling, n=1), stop_ids)
        finally:
            self.model.train(was_training)
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], responses=responses, logprobs=logprobs,
                            finish_reasons=reasons)

    def _chunks_of_every_rank(self, mine: int) -> int:
        if self.sync_group is None:
            return mine
        count = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.sync_group)
        return int(count.item())

    def _targets(self) -> dict[str, torch.Tensor]:
        # remove_duplicate=False: a tied lm_head.weight is accepted under either of its names.
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        return targets

    @staticmethod
    def _target(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
        target = targets.get(name)
        if target is None:
            near = difflib.get_close_matches(name, list(targets), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise RolloutError(f"{what}: the model has no parameter or buffer named '{name}'{hint}")
        if target.shape != tensor.shape:
            raise RolloutError(f"{what}: '{name}' has shape {tuple(target.shape)} in the model but "
                               f"{tuple(tensor.shape)} was sent")
        return target

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy by name into an unpartitioned model (dtype cast allowed, shape must match). A hybrid engine
        that generates with the actor's own ZeRO-3 module needs no loading at all."""
        targets = self._targets()
        loaded = 0
        for name, tensor in named_tensors:
            self._target(targets, name, tensor, "load_weights").copy_(tensor)
            loaded += 1
        return loaded

    @torch.no_grad()
    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """LoRA RL: copy the adapter's tensors (names of PEFT's adapter file) into this engine's peft model (built
        by the caller over the frozen base: `models.lora.apply_lora`); the base weights stay as they are."""
        if self._adapter is None:
            if not is_peft_model(self.model):
                raise RolloutError("load_adapter: this hf engine's model has no LoRA adapter (build it with the "
                                   "actor's lora settings to sync adapters)")
            self._adapter = adapter_parameters(self.model)
        loaded = 0
        for name, tensor in named_tensors:
            self._target(self._adapter, name, tensor, "load_adapter").copy_(tensor)
            loaded += 1
        return loaded

    @torch.no_grad()
    def adopt_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[int]:
        """Take the tensors as the model's own parameters, uncopied, where dtype and device match (views into
        receive buffers this engine keeps: `received_buffers`); copy them otherwise (a dtype cast, a buffer).
        Returns the ids of the parameters now up to date."""
        targets = self._targets()
        parameters = {id(p) for p in self.model.parameters()}
        done = set()
        for name, tensor in named_tensors:
            target = self._target(targets, name, tensor, "adopt_weights")
            if id(target) in parameters and tensor.dtype == target.dtype and tensor.device == target.device:
                target.data = tensor
            else:
                target.copy_(tensor)
            done.add(id(target))
        return done

    def sleep(self) -> None:
        """On GPU: weights to host memory and the allocator's cache released. On CPU: nothing to free.

        Both decode loops build a fresh KV cache for every chunk and drop it on return, so between calls only
        the weights hold device memory.
        """
        device = self.device
        if device.type == "cpu" or self._home_device is not None:
            return
        self._home_device = device
        self.model.to("cpu")
        self.received_buffers.clear()  # the weights were copied out of them; the next sync makes new ones
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self._home_device is None:
            return
        self.model.to(self._home_device)
        self._home_device = None


@contextlib.contextmanager
def _peers_agree_in(group):
    """transformers' synced_gpus asks "has every rank finished?" with a group-less all_reduce (the whole world);
    inside this block such calls go to `group`."""
    if group is None:
        yield
        return
    original, sync = dist.all_reduce, group

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return original(tensor, op=op, group=sync if group is None else group, async_op=async_op)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original
