"""`hpc-rlhf plan --calibrate [--profile PATH]`: measure this machine into the `cpu` hardware profile of the
step-time model (where it is written: hardware.cpu_profile_path, or PATH).

One thread per rank, as the CPU runs use (DESIGN §7). Measured, each as the fastest of several repeats (the
machine's speed undisturbed; the job's own ranks sharing the cores is the step-time model's part):
- peak_flops: an fp32 matrix product of 1024 x 1024 matrices on one thread;
- memory_bytes_per_s: copying 128 MB (read + write);
- the project's own pieces on the built-in tiny model (models/tiny/llama-tiny.json, random weights: speed does
  not depend on what they learnt): a forward pass of a micro-batch at two batch sizes (the difference gives
  mfu_score, what is left at batch 0 pass_overhead_s); the rollout engine's decode (engines/rollout/hf.py) at
  two batch sizes (decode_step_overhead_s, mfu_decode); forward + backward and an optimizer step of the training
  engine (engines/train.py, DeepSpeed ZeRO-0 on a one-rank gloo world: mfu_train, optimizer_step_overhead_s);
- latency_s and the link bandwidth: two gloo processes, a small message back and forth and 16 MB one way.
`cores`: the CPUs this process may run on. The machine's load average at the time is recorded with the profile:
measurements on a machine shared with other work are slower than on an idle one, and vary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_rlhf.dist.memory import ModelShape
from hpc_rlhf.scale import hardware
from hpc_rlhf.scale.step_time import forward_flops

TINY_CONFIG = Path(__file__).resolve().parents[1] / "models" / "tiny" / "llama-tiny.json"
PROMPT_LEN, NEW_TOKENS = 8, 16
BATCHES = (4, 64)  # two batch sizes: the difference gives the rate, what is left at 0 the fixed cost


def _best_time(fn, repeats: int = 9, warmup: int = 1) -> float:
    """The fastest of `repeats` runs: this machine's speed when nothing else took the core meanwhile. (Medians
    of a few repeats on a shared 2-core machine moved the fitted rates by 3x between two calibrations minutes
    apart; the fastest runs are stable. Contention between the job's own ranks is the model's, step_time._busy.)"""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _fit(x1: float, t1: float, x2: float, t2: float) -> tuple[float, float]:
    """(intercept, slope) of the line through two measurements, the intercept at least 0."""
    slope = max((t2 - t1) / (x2 - x1), 1e-15)
    return max(0.0, t1 - slope * x1), slope


def matmul_flops() -> float:
    """The best of fp32 matrix products of a few sizes (one thread)."""
    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = max(best, 2 * n**3 / _best_time(lambda: torch.mm(a, b)))
    return best


def copy_bandwidth() -> float:
    src = torch.ones(32 * 2**20)  # 128 MB of fp32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src))


def tiny_model():
    import transformers  # heavy: only the calibration needs it

    config = json.loads(TINY_CONFIG.read_text())
    shape = ModelShape.from_config(config, str(TINY_CONFIG), name="llama-tiny")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{
        k: v for k, v in config.items() if k not in ("model_type", "architectures")}), dtype=torch.float32)
    return model, shape, config


def forward_fit(model, shape, peak: float, seq: int = PROMPT_LEN + NEW_TOKENS) -> tuple[float, float]:
    """(pass_overhead_s, mfu_score) from forward passes of BATCHES sequences."""
    times = {}
    for batch in BATCHES:
        ids = torch.randint(3, 100, (batch, seq))
        with torch.no_grad():
            times[batch] = _best_time(lambda: model(input_ids=ids, use_cache=False))
    small, large = BATCHES
    overhead, slope = _fit(forward_flops(shape, small, seq), times[small], forward_flops(shape, large, seq),
                           times[large])
    return overhead, min(1.0, 1 / (slope * peak))


def decode_fit(model, shape, config, peak: float) -> tuple[float, float]:
    """(decode_step_overhead_s, mfu_decode) from the rollout engine generating BATCHES sequences."""
    # the engine the CPU runs generate with (imported here: `plan` without --calibrate imports no torch)
    from hpc_rlhf.engines.rollout.base import SamplingParams
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(model, pad_id=config.get("pad_token_id", 0), eos_id=config["vocab_size"] - 1)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=1)
    per_step = {}
    for batch in BATCHES:
        prompts = [[5 + (i % 90)] * PROMPT_LEN for i in range(batch)]
        out = []

        def run():
            out.append(engine.generate(prompts, sampling))
        seconds = _best_time(run, repeats=5)
        steps = max(len(r) for r in out[-1].flat_responses())
        per_step[batch] = seconds / max(1, steps)
    flops = 2 * shape.active_params
    small, large = BATCHES
    overhead, slope = _fit(small * flops, per_step[small], large * flops, per_step[large])
    return overhead, min(1.0, 1 / (slope * peak))


def training_fit(model, shape, peak: float, pass_overhead: float) -> tuple[float, float]:
    """(mfu_train, optimizer_step_overhead_s) from the training engine on a one-rank gloo world."""
    # DeepSpeed's engine, imported only when the calibration gets to it (seconds of import)
    from hpc_rlhf.config import TrainSection
    from hpc_rlhf.engines.train import TrainEngine

    seq = PROMPT_LEN + NEW_TOKENS
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):  # DeepSpeed asks for them
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            engine = TrainEngine(model, TrainSection(lr=1e-5, warmup_steps=0, micro_batch_size=32, batch_size=32,
                                                     max_steps=1000))
            times, cycles = {}, {}
            for batch in BATCHES:
                ids = torch.randint(3, 100, (batch, seq))

                def forward_backward():
                    engine.backward(engine.forward(input_ids=ids, use_cache=False).logits.float().mean())

                def cycle():
                    forward_backward()
                    engine.step()
                times[batch] = _best_time(forward_backward)
                cycles[batch] = _best_time(cycle)
        finally:
            dist.destroy_process_group()
    small, large = BATCHES
    _, slope = _fit(3 * forward_flops(shape, small, seq), times[small] - 2 * pass_overhead,
                    3 * forward_flops(shape, large, seq), times[large] - 2 * pass_overhead)
    step = statistics.median([max(0.0, cycles[b] - times[b]) for b in BATCHES])
    return min(1.0, 1 / (slope * peak)), step


def _gloo_peer(rank: int, store: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    small, big = torch.zeros(2), torch.zeros(4 * 2**20)  # 8 bytes, 16 MB
    other = 1 - rank
    for _ in range(3):  # warm-up
        dist.send(small, other) if rank == 0 else dist.recv(small, other)
        dist.recv(small, other) if rank == 0 else dist.send(small, other)
    rounds, start = 50, time.perf_counter()
    for _ in range(rounds):
        dist.send(small, other) if rank == 0 else dist.recv(small, other)
        dist.recv(small, other) if rank == 0 else dist.send(small, other)
    latency = (time.perf_counter() - start) / rounds / 2
    times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        dist.send(big, other) if rank == 0 else dist.recv(big, other)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(result).write_text(json.dumps({"latency_s": latency,
                                            "bytes_per_s": big.numel() * 4 / statistics.median(times)}))
    dist.destroy_process_group()


def gloo_link() -> dict:
    import multiprocessing

    with tempfile.TemporaryDirectory() as tmp:
        ctx = multiprocessing.get_context("spawn")
        result = f"{tmp}/link.json"
        procs = [ctx.Process(target=_gloo_peer, args=(rank, f"{tmp}/store", result)) for rank in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        return json.loads(Path(result).read_text())


def measure() -> tuple[hardware.Profile, dict]:
    torch.set_num_threads(1)
    peak = matmul_flops()
    memory = copy_bandwidth()
    model, shape, config = tiny_model()
    pass_overhead, mfu_score = forward_fit(model, shape, peak)
    decode_overhead, mfu_decode = decode_fit(model, shape, config, peak)
    mfu_train, step_overhead = training_fit(model, shape, peak, pass_overhead)
    link = gloo_link()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load = os.getloadavg()[0]
    profile = hardware.Profile(
        "cpu", peak_flops=peak, memory_bytes_per_s=memory, intra_node_bytes_per_s=link["bytes_per_s"],
        inter_node_bytes_per_s=link["bytes_per_s"], latency_s=link["latency_s"], memory_gb=round(total_gb, 1),
        mfu_train=mfu_train, mfu_score=mfu_score, mfu_decode=mfu_decode, memory_efficiency=1.0,
        decode_step_overhead_s=decode_overhead, pass_overhead_s=pass_overhead, optimizer_step_overhead_s=step_overhead,
        cores=cores, bytes_per_param=4,
        source=f"measured on {socket.gethostname()} at {when} by `hpc-rlhf plan --calibrate` (one thread; load "
               f"average {load:.1f} on {cores} cores)")
    measured = {"when": when, "load_average_1min": load, "tiny_model_params": shape.num_params,
                "torch": torch.__version__}
    return profile, measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rlhf plan --calibrate",
                                     description="Measure this machine into the `cpu` profile of the step-time model.")
    parser.add_argument("--profile", default=None, help=f"where to write it (default: {hardware.cpu_profile_path()})")
    args = parser.parse_args(argv)
    profile, measured = measure()
    path = hardware.save_cpu_profile(profile, measured, Path(args.profile) if args.profile else None)
    fields = {k: v for k, v in profile.to_dict().items() if k != "source"}
    print(json.dumps(fields, indent=1))
    print(f"{profile.source}\nwritten to {path}", file=sys.stderr)
    return 0
