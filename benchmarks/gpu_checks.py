"""Every check one GPU can make, in one run of under 10 minutes (an H100 or H200 lent for a few minutes, or the first
node of a new cluster), each a command of its own with a time limit; prints one line per check and a table.

1. nccl        `hpc-rlhf bandwidth --backend nccl` on a one-rank world (torchrun): NCCL initialises, the rank
               finds its device through CUDA_VISIBLE_DEVICES (hpc_rlhf.dist.devices), a 1 GB all-reduce runs
2. bf16 train  benchmarks/gpu_throughput.py: bf16 steps of a 1.1B Llama through the training engine (DeepSpeed
               ZeRO-2): tokens/s and MFU; needs DeepSpeed
3. generation  benchmarks/hf_generation.py on the 1.1B model in bf16: the hf engine's lean decode loop against
               transformers' generate
4. packed rl   benchmarks/rl_packing.py: the actor's log-probs on packed rows (flash-attention's varlen kernel
               where flash-attn is installed) against padded ones (sdpa): the difference and the speed-up
5. sequence    benchmarks/sequence_parallel.py --device cuda: a sequence block of one rank (no exchanges) on one
   parallel    packed row, flash-attention's varlen path of the sharded attention against transformers' packed
               flash forward and the per-sample sdpa path: log-prob differences (fails above 0.02), saved MB,
               forward + backward ms; needs flash-attn
6. vllm        vLLM's CUDA build: its compiled ops load (`vllm._C`); needs vLLM
7. weight sync `benchmarks/weight_sync.py` on two ranks needs two GPUs for NCCL (one GPU cannot host two NCCL
               ranks): listed, not run, on a one-GPU machine

A check whose library is missing is reported as skipped with the reason, not failed. Nothing is asserted: the
lines are the record (docs/results.md).

    python benchmarks/gpu_checks.py                 # on the GPU machine, from the repository root
    python benchmarks/gpu_checks.py --only nccl generation
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def checks(python: str, gpus: int) -> dict[str, dict]:
    """name -> {"cmd", "timeout", "headline" (a regex for the line to keep), "needs" (a module), "skip"}"""
    return {
        "nccl": {"cmd": [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
                         "hpc_rlhf", "bandwidth", "--backend", "nccl", "--size-mb", "1024", "--iters", "20"],
                 "timeout": 120, "headline": r"^all-reduce of .*$"},
        "bf16 train": {"cmd": [python, str(HERE / "gpu_throughput.py"), "--steps", "10", "--warmup", "3"],
                       "timeout": 240, "headline": r"(?i)^.*(tokens/s|mfu).*$", "needs": "deepspeed"},
        "generation": {"cmd": [python, str(HERE / "hf_generation.py"), "--model", "1b", "--device", "cuda",
                               "--dtype", "bfloat16", "--prompts", "16", "--n", "8", "--new-tokens", "64",
                               "--repeats", "2"],
                       "timeout": 240, "headline": r"^.*lean / generate.*$"},
        "packed rl": {"cmd": [python, str(HERE / "rl_packing.py"), "--device", "cuda", "--dtype", "bfloat16",
                              "--samples", "64"],
                      "timeout": 180, "headline": r"^\| packed, longest-sample rows .*$"},
        "sequence parallel": {"cmd": [python, str(HERE / "sequence_parallel.py"), "--device", "cuda", "--tokens",
                                      "16384", "--require-flash"],
                              "timeout": 180, "headline": r"^flash path against the packed flash forward.*$",
                              "needs": "flash_attn"},
        "vllm": {"cmd": [python, "-c", "import vllm, vllm._C; print('vLLM', vllm.__version__, 'compiled ops load')"],
                 "timeout": 120, "headline": r"^vLLM .*$", "needs": "vllm"},
        "weight sync": {"cmd": [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                str(HERE / "weight_sync.py"), "--buckets", "256", "--repeats", "3", "--ranks", "2"],
                        "timeout": 240, "headline": r"^.*bucketed 256 MB.*$",
                        "skip": None if gpus >= 2 else "two NCCL ranks need two GPUs"},
    }


def run_check(name: str, check: dict) -> tuple[str, float, str]:
    """(outcome, seconds, line): outcome is ok, FAILED, skipped or TIMEOUT."""
    if check.get("skip"):
        return "skipped", 0.0, check["skip"]
    if check.get("needs") and importlib.util.find_spec(check["needs"]) is None:
        return "skipped", 0.0, f"{check['needs']} is not installed"
    start = time.perf_counter()
    try:
        proc = subprocess.run(check["cmd"], cwd=REPO, capture_output=True, text=True, timeout=check["timeout"])
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.perf_counter() - start, f"no result within {check['timeout']} s"
    seconds = time.perf_counter() - start
    found = re.findall(check["headline"], proc.stdout, re.MULTILINE)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        return "FAILED", seconds, f"exit {proc.returncode}: {tail[:300]}"
    return "ok", seconds, (found[-1].strip() if found else proc.stdout.strip().splitlines()[-1][:300])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=None, help="run these checks only (names as listed)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the checks run with")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu_checks: no CUDA GPU here: these checks are for a GPU machine", file=sys.stderr)
        return 2
    every = checks(args.python, gpus)
    unknown = sorted(set(args.only or []) - set(every))
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose from {sorted(every)}")
    print(f"# one-GPU checks: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{gpus} GPU(s)", flush=True)
    rows = []
    for name, check in every.items():
        if args.only and name not in args.only:
            continue
        outcome, seconds, line = run_check(name, check)
        print(f"{name}: {outcome} ({seconds:.0f} s): {line}", flush=True)
        rows.append((name, outcome, f"{seconds:.0f}", line))
    print("\n| check | outcome | s | result |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if any(outcome in ("FAILED", "TIMEOUT") for _, outcome, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
