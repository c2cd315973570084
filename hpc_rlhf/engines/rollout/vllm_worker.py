"""What runs inside vLLM's own processes: the weight-transfer engines of our two transports, registered with
vLLM's weight-transfer factory, and the worker extension that reads the worker's weights back as digests.

vLLM's worker imports this module when it resolves `worker_extension_cls`, before it builds its model and its
weight-transfer engine, so the registrations below are in place when vLLM looks the backend up. It imports vLLM at
the top: only processes that run vLLM import it (`hpc_rlhf.engines.rollout.vllm` names it by string).

Why transports of our own behind vLLM's weight-transfer API (vLLM 0.32; figures in benchmarks/rollout_engines.py):
the API (`LLM.start_weight_update` / `update_weights` / `finish_weight_update`, one `WeightTransferEngine` per
worker chosen by `weight_transfer_config.backend`, backends registered with `WeightTransferEngineFactory`) serves
CPU and GPU alike, and its start/finish pair runs vLLM's layerwise reload, which the CPU backend needs: after
loading, vLLM's CPU linear layers repack their weights for oneDNN and drop the `weight` parameter, so a plain
`model.load_weights` later fails part-way (measured: "'Parameter' object has no attribute 'weight_loader'", and
the engine then generated from a mix of old and new weights). The transports vLLM ships are CUDA-only (`ipc`
rebuilds CUDA IPC handles, `nccl`/`sparse_nccl`/`nccl_m2n` need NCCL), and its `ipc` engine rebuilds the buffer on
the worker's own GPU, which is wrong for a tensor-parallel engine fed by one rank. Two small engines therefore
share vLLM's lifecycle and the bucket layout, and differ only in how the worker reaches the buffer: a memfd mapped
through /proc (CPU), a CUDA IPC handle rebuilt on the GPU that holds it. The transport-free alternative, the
bucket's bytes as `collective_rpc` arguments through vLLM's engine core, was 3.1-3.8x slower on CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
import os
import warnings

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from hpc_rlhf.engines.rollout.vllm_transfer import CUDA_IPC_BACKEND, SHM_BACKEND, bucket_views, rebuild_cuda_buffer

NOTIFY_RECHECK_MS = 10  # the sleeping worker looks at its queue this often even without a notification


@dataclasses.dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """Nothing to agree on beforehand: every update names its buffer."""


@dataclasses.dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: where each tensor lies in the buffer (`nbytes` long), and the buffer itself: `path` (CPU: a file
    this process can open) or `handle` + `device_uuid` (GPU: a pickled CUDA IPC handle, base64)."""
    nbytes: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    path: str | None = None
    handle: str | None = None
    device_uuid: str | None = None

    def __post_init__(self):
        sizes = {len(self.names), len(self.dtype_names), len(self.shapes), len(self.offsets)}
        if len(sizes) != 1:
            raise ValueError(f"weight update: {len(self.names)} names, {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes and {len(self.offsets)} offsets must be as many")


class _BucketEngine(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """Loads buckets packed by `vllm_transfer` (one `update_weights` call per bucket) inside vLLM's layerwise
    reload, as vLLM's own ipc engine does. Subclasses say how the buffer is reached (`_buffer`)."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def _buffer(self, update_info: BucketUpdateInfo) -> torch.Tensor:
        raise NotImplementedError

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        # Copies: the layerwise reload keeps what it is given until the layer is complete, and the buffer holds
        # the next bucket by then.
        views = bucket_views(self._buffer(update_info), update_info.names, update_info.dtype_names,
                             update_info.shapes, update_info.offsets, update_info.nbytes)
        self.model.load_weights([(name, view.clone()) for name, view in views])


class SharedMemoryWeightTransferEngine(_BucketEngine):
    """CPU: the buffer is a memfd of the driving rank (`vllm_transfer.SharedBuffer`), mapped once and again only
    when it grew."""

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._mapped: tuple[str, int, mmap.mmap, torch.Tensor] | None = None

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(): nothing is asynchronous on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def _buffer(self, update_info: BucketUpdateInfo) -> torch.Tensor:
        path, nbytes = update_info.path, update_info.nbytes
        if path is None:
            raise ValueError("weight update: the shared-memory backend needs update_info['path']")
        if self._mapped is None or self._mapped[0] != path or self._mapped[1] < nbytes:
            self.shutdown()
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    raise ValueError(f"weight update: {path} holds {size} bytes, {nbytes} announced")
                region = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # a read-only mapping: it is only read (and cloned)
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(region, dtype=torch.uint8)
            self._mapped = (path, size, region, tensor)
        return self._mapped[3]

    def shutdown(self) -> None:
        if self._mapped is not None:
            region = self._mapped[2]
            self._mapped = None  # the tensor's export of the mapping goes first, or close() refuses
            try:
                region.close()
            except BufferError:
                pass  # a view is still alive somewhere: the mapping goes with it


class CudaIpcWeightTransferEngine(_BucketEngine):
    """GPU: the buffer lives on the driving rank's GPU. Rebuilt on that GPU (found by uuid among the ones this
    worker sees), not on the worker's own as vLLM's ipc engine does: a tensor-parallel engine driven by one rank
    has one buffer for all its workers, and each copies its shard out of it."""

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._rebuilt: tuple[str, torch.Tensor] | None = None

    def _buffer(self, update_info: BucketUpdateInfo) -> torch.Tensor:
        if update_info.handle is None or update_info.device_uuid is None:
            raise ValueError("weight update: the CUDA IPC backend needs update_info['handle'] and ['device_uuid']")
        if self._rebuilt is None or self._rebuilt[0] != update_info.handle:
            from vllm import envs

            if not envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
                raise ValueError("weight update: a CUDA IPC handle is unpickled only with "
                                 "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the driving rank sets it)")
            self._rebuilt = (update_info.handle, rebuild_cuda_buffer(update_info.handle, update_info.device_uuid))
        return self._rebuilt[1]

    def shutdown(self) -> None:
        self._rebuilt = None


class _RotaryCacheIsNotAWeight(logging.Filter):
    """vLLM's layerwise reload warns "<layer>: Failed to load weights" for every layer that got none; rotary
    embeddings hold only a computed cos/sin cache, which no checkpoint carries, so on every sync that warning is
    noise (the cache is kept, as it should be)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryCacheIsNotAWeight())

def _wait_for_work_without_spinning() -> None:
    """On CPU, a worker in a process of its own (when the user pins vLLM's threads: `vllm.engine_kwargs`) waits for
    its next order from vLLM's engine core by sleeping, not by spinning.

    After each order it reads, vLLM's worker busy-loops (sched_yield) for a second on the shared-memory queue
    before it sleeps on its notification socket (`shm_broadcast.SpinCondition`, `busy_loop_s=1`). On a GPU node
    that costs an otherwise idle core; on CPU, where the engine's ranks share the cores with the trained roles,
    the worker spun through every phase of an RL step that was not generation. Measured on 2 cores (GRPO hybrid,
    30 steps, the built-in task): the worker's CPU time 28.3 s -> 14.3 s, wall time and every figure unchanged.
    Only the worker's reading side changes: the engine core keeps spinning on the worker's answers, because
    making it sleep too slowed generation (wall time 52 s -> 69 s). This module is imported in the worker before
    it creates its queues (the worker extension is resolved first), so the queues it creates take the setting.

    A sleeping worker also looks at its queue every NOTIFY_RECHECK_MS without being woken: the engine core's
    wake-ups get lost now and then (the likely cause, not traced further: its notification socket has a send
    high-water mark of 1 and drops what it cannot queue), and vLLM's own recheck comes after 5 s. Sleeping on
    the wake-up alone, PPO with two vLLM engines (random tiny models, 40 steps, 2 cores) stalled 5 s in 3-9
    steps of 40 (71-96 s wall); rechecking, none (43-44 s), about vLLM's own spinning wait in wall time (GRPO
    hybrid 43.6 s against 42.9 s) without its CPU (45 + 3.9 CPU-s against 54.7 + 6.2)."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(shm_broadcast.SpinCondition, "_hpc_rlhf_no_spin", False):
        return
    spin_init, spin_wait = shm_broadcast.SpinCondition.__init__, shm_broadcast.SpinCondition.wait

    def init_without_spinning(self, is_reader, context, notify_address, busy_loop_s=1.0):
        spin_init(self, is_reader, context, notify_address, busy_loop_s=0.0)

    def wait_rechecking(self, timeout_ms=None):
        spin_wait(self, timeout_ms=NOTIFY_RECHECK_MS if timeout_ms is None else min(timeout_ms, NOTIFY_RECHECK_MS))

    shm_broadcast.SpinCondition.__init__ = init_without_spinning
    shm_broadcast.SpinCondition.wait = wait_rechecking
    shm_broadcast.SpinCondition._hpc_rlhf_no_spin = True


_wait_for_work_without_spinning()

for _name, _engine in ((SHM_BACKEND, SharedMemoryWeightTransferEngine),
                       (CUDA_IPC_BACKEND, CudaIpcWeightTransferEngine)):
    if _name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(_name, _engine)


# ------------------------------------------------------------------------------------------ reading back
def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal digests mean equal tensors, bit for bit."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _kernel_weight(module: torch.nn.Module, in_features: int) -> torch.Tensor:
    """The [out, in] weight a linear kernel computes with. vLLM's CPU backend repacks linear weights for its
    kernels (and drops the parameter), so they are read back through the kernel: y = x W^T with x the identity
    gives W^T exactly (every output is one product by 1 plus products by 0)."""
    weight = getattr(module, "weight", None)
    if not hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
        return weight.detach()
    dtype = weight.dtype if weight is not None and weight.numel() > 0 else module.params_dtype
    eye = torch.eye(in_features, dtype=dtype, device=weight.device if weight is not None else "cpu")
    with torch.no_grad():
        return module.quant_method.apply(module, eye, bias=None).t().contiguous()


def hf_weight_digests(model: torch.nn.Module) -> dict[str, str]:
    """Digest per Hugging Face parameter name of a vLLM model's weights as its kernels use them (tensor
    parallelism 1): fused projections (qkv_proj, gate_up_proj) are split back by the model's
    packed_modules_mapping, vocabulary padding is cut off."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out: dict[str, str] = {}
    for prefix, module in model.named_modules():
        own = {n: p for n, p in module._parameters.items() if p is not None}
        if isinstance(module, ParallelLMHead):
            weight = _kernel_weight(module, module.embedding_dim)[:module.org_vocab_size]
            out[f"{prefix}.weight"] = tensor_digest(weight)
        elif isinstance(module, VocabParallelEmbedding):
            out[f"{prefix}.weight"] = tensor_digest(module.weight[:module.org_vocab_size])
        elif isinstance(module, LinearBase):
            weight = _kernel_weight(module, module.input_size)
            parent, _, leaf = prefix.rpartition(".")
            parts = packed.get(leaf)
            if parts and len(parts) == len(getattr(module, "output_sizes", ())):
                for part, piece in zip(parts, weight.split(list(module.output_sizes), dim=0)):
                    out[f"{parent}.{part}.weight"] = tensor_digest(piece)
            else:
                out[f"{prefix}.weight"] = tensor_digest(weight)
            if own.get("bias") is not None and own["bias"].numel():
                out[f"{prefix}.bias"] = tensor_digest(own["bias"])
        else:
            for name, param in own.items():
                if param.numel():
                    out[f"{prefix}.{name}" if prefix else name] = tensor_digest(param)
    return out


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); reached with `LLM.collective_rpc(name)`."""

    def hpc_rlhf_weight_digests(self) -> dict[str, str]:
        if self.parallel_config.tensor_parallel_size != 1:
            raise RuntimeError("weight digests read whole tensors: tensor_parallel_size must be 1")
        return hf_weight_digests(self.model_runner.get_model())

    def hpc_rlhf_process_info(self, names: list[str]) -> dict:
        """This worker's pid, the environment variables `names` (None where unset) and the size of the torch world
        it belongs to (vLLM's own, never ours)."""
        import torch.distributed as dist

        return {"pid": os.getpid(), "env": {name: os.environ.get(name) for name in names},
                "world_size": dist.get_world_size() if dist.is_initialized() else None,
                "init_method": getattr(self, "distributed_init_method", None)}
