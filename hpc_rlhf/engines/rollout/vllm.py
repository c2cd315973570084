"""Rollout with vLLM on GPUs, written against vLLM's documented Python API (`LLM`, `SamplingParams`,
`TokensPrompt`, sleep mode, `collective_rpc` with a worker extension class).

NOT RUN in this project: vLLM cannot be installed on the CPU development machine (it pins an exact torch and
is a 336 MB wheel, DESIGN §9), so only the pure parts below are tested: the translation of our
SamplingParams, the conversion of vLLM's outputs into a RolloutBatch, the spawn environment, the bucket
layout handed to vLLM's workers and the worker-side loader (with its CUDA calls faked). Importing this module does not import vLLM; creating an engine without it
raises one clear error.

Placements (DESIGN §3, §9). vLLM's `external_launcher` executor would take our whole torch world as its
own, so vLLM never runs inside our world here; it always runs in processes it starts itself (its default
multiprocessing engine core, plus one worker per GPU when tensor_parallel_size > 1):

* Disjoint (`rollout=8 rollout_tp=2`): one rank of our world per engine creates a `VLLMRolloutEngine` with
  `gpu_ids` = the engine's GPUs on its node; the engine's other ranks do no CUDA work, leaving their GPUs to
  vLLM. The driving rank belongs to the weight-sync group: it receives buckets with
  `weight_sync.receive_weights(src, group, engine.load_weights)` on its own GPU, and `load_weights` hands
  them to vLLM's workers as CUDA IPC handles through `collective_rpc` (vLLM's RLHF weight-update pattern);
  each worker calls `model_runner.model.load_weights`, which also shards the full tensors for tensor
  parallelism. The driving rank's GPU is one of `gpu_ids`, so lower `gpu_memory_utilization` to leave room
  for its own CUDA context and one bucket.
* Colocated / hybrid (`rollout@actor`): every actor rank hosts an engine with tensor_parallel_size 1 on its own
  GPU and `enable_sleep_mode=True`. The engine sleeps while the actor trains; before generating, the rank
  calls `weight_sync.load_local_weights(actor params, engine.load_weights)` (which wakes the weights only)
  and then `wake()` (the KV cache).

Log-probs: the engine asks vLLM for `logprobs_mode="processed_logprobs"` and `logprobs=0` (the sampled token
only), i.e. the log-softmax of the logits after temperature *and* after top-k/top-p truncation. Without
truncation (top_k 0, top_p 1) this is exactly the HF engine's `log_softmax(logits / T)`; with truncation,
vLLM's value is renormalised over the kept tokens and so is larger than the HF engine's.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Sequence

import torch

from hpc_rlhf.dist.weight_sync import Bucket, Bucketer
from hpc_rlhf.engines.rollout.base import (RolloutBatch, RolloutEngine, RolloutError, SamplingParams,
                                           check_prompts, cut_at_stop)

WORKER_EXTENSION = f"{__name__}.WorkerExtension"
# Launcher variables of our own world: vLLM's processes must not believe they are part of it.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise RolloutError("rollout engine 'vllm' needs the vllm package (pip install 'hpc_rlhf[vllm]', on a GPU "
                           "machine whose torch matches the vllm wheel); use rollout engine 'hf' otherwise "
                           f"({exc})") from None
    return vllm


# ------------------------------------------------------------------------------------------ pure helpers
def vllm_sampling_kwargs(sampling: SamplingParams, stop_ids: Sequence[int], num_prompts: int) -> list[dict]:
    """Keyword arguments of `vllm.SamplingParams`, one dict per prompt.

    vLLM gives the n samples of a seeded request the seeds seed, seed+1, ..., seed+n-1, so prompt i gets base
    seed `seed + i * n`: no two samples of one call share a random stream.
    """
    common = dict(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                  top_k=sampling.top_k if sampling.top_k > 0 else -1,  # -1 is "off" in every vLLM version
                  max_tokens=sampling.max_new_tokens, stop_token_ids=list(stop_ids), ignore_eos=False,
                  logprobs=0, detokenize=False, skip_special_tokens=False)
    if sampling.seed is None:
        return [dict(common) for _ in range(num_prompts)]
    return [dict(common, seed=sampling.seed + i * sampling.n) for i in range(num_prompts)]


def rollout_batch_from_outputs(prompt_ids: list[list[int]], request_outputs: Sequence[Any],
                               sampling: SamplingParams, stop_ids: Sequence[int]) -> RolloutBatch:
    """vLLM `RequestOutput`s (one per prompt, in prompt order) -> RolloutBatch.

    Reads `outputs[j].token_ids`, `.logprobs` (one {token_id: Logprob} dict per token) and `.finish_reason`.
    """
    if len(request_outputs) != len(prompt_ids):
        raise RolloutError(f"vLLM returned {len(request_outputs)} results for {len(prompt_ids)} prompts")
    responses, logprobs, reasons = [], [], []
    for i, request in enumerate(request_outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != sampling.n:
            raise RolloutError(f"vLLM returned {len(completions)} samples for prompt {i}, expected n={sampling.n}")
        toks, lps, why = [], [], []
        for j, completion in enumerate(completions):
            token_ids = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
                raise RolloutError(f"vLLM gave prompt {i} sample {j} no log-prob per token (logprobs=0 and "
                                   "detokenize=False must reach vllm.SamplingParams)")
            if completion.finish_reason not in ("stop", "length"):
                raise RolloutError(f"vLLM finished prompt {i} sample {j} with reason "
                                   f"{completion.finish_reason!r} (aborted request?)")
            tokens = torch.tensor(token_ids, dtype=torch.int64)
            keep, _ = cut_at_stop(tokens, stop_ids, len(token_ids))
            values = [per_token[t].logprob for t, per_token in zip(token_ids[:keep], completion.logprobs)]
            toks.append(tokens[:keep])
            lps.append(torch.tensor(values, dtype=torch.float32))
            why.append(completion.finish_reason)
        responses.append(toks)
        logprobs.append(lps)
        reasons.append(why)
    return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], responses=responses, logprobs=logprobs,
                        finish_reasons=reasons)


def engine_kwargs(model_path: str, *, tensor_parallel_size: int, dtype: str, gpu_memory_utilization: float,
                  seed: int, enable_sleep_mode: bool, max_model_len: int | None, enforce_eager: bool,
                  extra: dict | None = None) -> dict:
    """Keyword arguments of `vllm.LLM` for a rollout engine (extra ones override)."""
    kwargs = dict(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                  gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep_mode=enable_sleep_mode,
                  enforce_eager=enforce_eager, worker_extension_cls=WORKER_EXTENSION,
                  logprobs_mode="processed_logprobs", distributed_executor_backend="mp" if tensor_parallel_size > 1
                  else None)
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(extra or {})
    return kwargs


@contextlib.contextmanager
def spawn_environment(gpu_ids: Sequence[int] | None):
    """Environment for creating vLLM's processes: our launcher variables removed, the engine's GPUs visible,
    the engine core in its own process, spawn instead of fork (forking a process that holds CUDA and NCCL
    state is unsafe). Restored on exit."""
    saved = {k: os.environ.get(k) for k in (*_LAUNCHER_VARS, "CUDA_VISIBLE_DEVICES", "VLLM_WORKER_MULTIPROC_METHOD",
                                            "VLLM_ENABLE_V1_MULTIPROCESSING")}
    try:
        for k in _LAUNCHER_VARS:
            os.environ.pop(k, None)
        if gpu_ids is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(g)) for g in gpu_ids)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # An in-process engine core would initialise vLLM's distributed state inside our torch world.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bucket_layout(bucket: Bucket) -> list[tuple]:
    """Plain-Python description of a bucket, (name, shape, element offset) per tensor, for collective_rpc."""
    return [(name, tuple(int(s) for s in shape), int(offset))
            for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets)]


def bucket_from_layout(flat: torch.Tensor, layout: Sequence[tuple]) -> Bucket:
    return Bucket(flat, [name for name, _, _ in layout], [shape for _, shape, _ in layout],
                  [offset for _, _, offset in layout])


def find_device_index(uuid: str, visible_uuids: Sequence[str]) -> int:
    """Local CUDA index of the GPU with this uuid, as seen by a process with its own CUDA_VISIBLE_DEVICES."""
    if uuid not in visible_uuids:
        raise RolloutError(f"the weight buffer lives on GPU {uuid}, which this vLLM worker cannot see "
                           f"(visible: {list(visible_uuids)}); the driving rank's GPU must be one of gpu_ids")
    return list(visible_uuids).index(uuid)


# ----------------------------------------------------------------------------------------- vLLM worker side
class WorkerExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`): receives weight buckets as CUDA IPC handles.

    Runs inside vLLM's worker processes, where `self.model_runner`, `self.device` and `self.model_config` are
    the worker's. Methods are reached through `LLM.collective_rpc(name, args=...)` on every worker.
    """

    def hpc_rlhf_load_bucket(self, ipc_handle: tuple, device_uuid: str, layout: list[tuple]) -> int:
        visible = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        rebuild, args = ipc_handle
        args = list(args)
        # torch's rebuild_cuda_tensor takes the device index as its 7th argument; the sender's index means
        # nothing under this process's CUDA_VISIBLE_DEVICES, so look the GPU up by uuid.
        args[6] = find_device_index(device_uuid, visible)
        flat = rebuild(*args)
        weights = bucket_from_layout(flat, layout).views()
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()
        return len(weights)

    def hpc_rlhf_finish_load(self) -> None:
        # Quantised and fused layers re-derive their kernels' layouts from the new weights.
        try:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading
        except ImportError:
            return
        process_weights_after_loading(self.model_runner.model, self.model_config, self.device)


# ------------------------------------------------------------------------------------------------ engine
class VLLMRolloutEngine(RolloutEngine):
    """A vLLM engine driven from one rank of our world (see the module docstring for placements)."""

    def __init__(self, model_path: str, eos_id: int, *, tensor_parallel_size: int = 1,
                 gpu_ids: Sequence[int] | None = None, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5,
                 seed: int = 0, enable_sleep_mode: bool = True, sleep_level: int = 1,
                 max_model_len: int | None = None, enforce_eager: bool = False, bucket_mb: float = 256.0,
                 extra_engine_args: dict | None = None):
        if sleep_level not in (1, 2):
            raise RolloutError(f"sleep_level must be 1 (weights to host memory) or 2 (weights dropped), got "
                               f"{sleep_level}")
        if gpu_ids is not None and len(gpu_ids) != tensor_parallel_size:
            raise RolloutError(f"gpu_ids {list(gpu_ids)} must list tensor_parallel_size={tensor_parallel_size} GPUs")
        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise RolloutError("rollout engine 'vllm' needs CUDA GPUs; use rollout engine 'hf' on CPU")
        self.eos_id = int(eos_id)
        self.sleep_level = sleep_level
        self.enable_sleep_mode = enable_sleep_mode
        self.bucket_mb = bucket_mb
        # The collective_rpc arguments carry torch's IPC rebuild function, which vLLM only serialises when
        # allowed to pickle; it is read whenever a message is encoded, so it stays set.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        kwargs = engine_kwargs(model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                               gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                               enable_sleep_mode=enable_sleep_mode, max_model_len=max_model_len,
                               enforce_eager=enforce_eager, extra=extra_engine_args)
        with spawn_environment(gpu_ids):
            self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self._asleep: set[str] = set()  # the parts now released: "weights", "kv_cache"

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        return [self.eos_id] + [t for t in sampling.stop_token_ids if t != self.eos_id]

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        check_prompts(prompt_ids)
        if self._asleep:
            raise RolloutError(f"generate() on a sleeping vLLM engine ({sorted(self._asleep)} released); "
                               "call wake() first")
        from vllm.inputs import TokensPrompt

        stop_ids = self._stop_ids(sampling)
        params = [self._vllm.SamplingParams(**kw) for kw in vllm_sampling_kwargs(sampling, stop_ids, len(prompt_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return rollout_batch_from_outputs(prompt_ids, outputs, sampling, stop_ids)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        device = torch.device("cuda", torch.cuda.current_device())
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        loaded = 0
        for bucket in Bucketer(int(self.bucket_mb * 2**20), device).buckets(named_tensors):
            torch.cuda.synchronize(device)  # the bucket's copies must land before another process reads it
            layout = bucket_layout(bucket)
            # collective_rpc returns once every worker has loaded the bucket, so the buffer may go afterwards.
            self.llm.collective_rpc("hpc_rlhf_load_bucket", args=(reduce_tensor(bucket.flat), uuid, layout))
            loaded += len(layout)
        self.llm.collective_rpc("hpc_rlhf_finish_load")
        # Cached prefixes hold keys and values computed with the old weights.
        self.llm.reset_prefix_cache()
        return loaded

    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped. Level 2: both dropped (the next load_weights must
        send every weight). Needs enable_sleep_mode=True."""
        if not self.enable_sleep_mode:
            raise RolloutError("sleep() needs the engine to be created with enable_sleep_mode=True")
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()
