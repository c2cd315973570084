"""The weight transfer into vLLM's worker without a vLLM engine: the bucket layout, both sides of the CPU
transport (the driving rank's memfd buffer, the worker's engine that maps it) in one process, the GPU transport's
worker side with its CUDA calls faked, and, on a CUDA GPU only, the GPU transport between two processes.
"""

import base64
import pickle
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.engines.rollout import vllm_transfer as vt

pytestmark = pytest.mark.vllm  # the worker's side imports vLLM; a skip fails CI (tests/ci_skips.py)


def mixed_tensors(seed: int, scale: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(5 * scale, 4, generator=generator)),
            ("model.norm.weight", torch.randn(3, generator=generator).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(5, 4 * scale, generator=generator)),
            ("step", torch.tensor([7, -1], dtype=torch.int64))]


def test_bucket_layout_aligns_every_tensor():
    offsets, nbytes = vt.bucket_layout(mixed_tensors(0))
    assert offsets == [0, 128, 192, 320] and nbytes == 336  # 80 B, 6 B, 80 B, 16 B, each from a 64-byte boundary


class FakeModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded.append([(name, tensor) for name, tensor in weights])


def test_shared_memory_transport_moves_buckets_bit_for_bit_and_grows():
    """Both sides of the CPU transport in one process: the driver packs into its memfd, the worker's engine maps
    it through /proc and loads copies (the buffer is overwritten by the next bucket)."""
    from hpc_rlhf.engines.rollout.vllm_worker import SharedMemoryWeightTransferEngine

    sender = vt.SharedBuffer()
    worker = object.__new__(SharedMemoryWeightTransferEngine)
    worker.model, worker._mapped = FakeModel(), None
    try:
        for seed, scale in ((0, 1), (1, 1), (2, 5000)):  # the last bucket is larger than the buffer: it grows
            sent = mixed_tensors(seed, scale)
            worker.update_weights(sender.bucket(sent))
            got = worker.model.loaded[-1]
            assert [n for n, _ in got] == [n for n, _ in sent]
            assert all(g.dtype == t.dtype and torch.equal(g, t) for (_, g), (_, t) in zip(got, sent, strict=True))
        assert sender.size >= vt.bucket_layout(mixed_tensors(2, 5000))[1]
        first = worker.model.loaded[0]
        assert torch.equal(first[0][1], mixed_tensors(0)[0][1])  # a copy: later buckets did not overwrite it
        info = sender.bucket(mixed_tensors(3))
        info["offsets"][2] = info["nbytes"]
        with pytest.raises(ValueError, match="'lm_head.weight' lies outside the buffer"):
            worker.update_weights(info)
    finally:
        worker.shutdown()
        sender.close()


def fake_rebuild(*args):
    """Stands for torch's rebuild_cuda_tensor (module level, so the handle pickles)."""
    fake_rebuild.devices.append(args[6])
    return fake_rebuild.buffer


def test_cuda_ipc_worker_rebuilds_the_buffer_on_the_gpu_that_holds_it(monkeypatch):
    """The GPU transport's worker side with its CUDA calls faked: the handle is unpickled (only when vLLM allows
    it), the buffer rebuilt on the GPU found by uuid, and every tensor loaded."""
    from hpc_rlhf.engines.rollout import vllm_worker

    tensors = mixed_tensors(0)
    offsets, nbytes = vt.bucket_layout(tensors)
    fake_rebuild.buffer, fake_rebuild.devices = torch.zeros(nbytes, dtype=torch.uint8), []
    vt.pack_into(fake_rebuild.buffer, tensors, offsets)
    handle = base64.b64encode(pickle.dumps((fake_rebuild, ("cls", 1, 1, 0, "storage", "dtype", 0, "h")))).decode()
    info = vt.update_info(tensors, offsets, nbytes, handle=handle, device_uuid="GPU-1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
    worker = object.__new__(vllm_worker.CudaIpcWeightTransferEngine)
    worker.model, worker._rebuilt = FakeModel(), None
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        worker.receive_weights(worker.parse_update_info(info))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    worker.receive_weights(worker.parse_update_info(info))
    worker.receive_weights(worker.parse_update_info(info))  # the same buffer: rebuilt once
    assert fake_rebuild.devices == [1]
    assert all(torch.equal(g, t) for (_, g), (_, t) in zip(worker.model.loaded[0], tensors, strict=True))
    with pytest.raises(ValueError, match="GPU-7, which this vLLM worker cannot see"):
        vt.find_device_index("GPU-7", ["GPU-0", "GPU-1"])


def _consume_cuda_bucket(info: dict) -> dict[str, str]:
    """In a spawned process, as vLLM's worker does: open the buffer from its IPC handle, read every tensor."""
    buffer = vt.rebuild_cuda_buffer(info["handle"], info["device_uuid"])
    views = vt.bucket_views(buffer, info["names"], info["dtype_names"], info["shapes"], info["offsets"],
                            info["nbytes"])
    return {name: view.cpu().view(torch.uint8).numpy().tobytes().hex() for name, view in views}


@pytest.mark.cuda  # the CUDA IPC transport needs a CUDA GPU: skipped without one
def test_cuda_ipc_transport_reaches_another_process_bit_for_bit():
    """GPU only (run on a lent H100, see docs/results.md): the driving rank's side packs buckets into its CUDA
    buffer; another process opens it by handle on the GPU found by uuid and reads each tensor exactly, also after
    the buffer grew (a new handle)."""
    sender = vt.CudaIpcBuffer(torch.device("cuda", 0))
    context = torch.multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        for seed, scale in ((0, 1), (1, 300)):
            tensors = [(name, t.cuda()) for name, t in mixed_tensors(seed, scale)]
            got = pool.apply(_consume_cuda_bucket, (sender.bucket(tensors),))
            assert got == {name: t.cpu().view(torch.uint8).numpy().tobytes().hex() for name, t in tensors}
    sender.close()
