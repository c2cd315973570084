"""Training throughput and MFU of hpc_rlhf's training engine on one GPU (written for an H200; see README).

A ~1.1B-parameter Llama (the TinyLlama-1.1B shape: hidden 2048, 22 layers, 32 heads / 4 KV heads, MLP 5632,
vocabulary 32000), random init, sdpa attention, bf16, DeepSpeed ZeRO-2 through `hpc_rlhf.engines.train
.TrainEngine` on a one-rank NCCL world, trained on random tokens (next-token loss on every position) for
`--steps` timed optimizer steps after `--warmup`. Prints tokens/s, TFLOP/s, MFU and peak memory.

FLOPs per token (PaLM, appendix B): 6 x N + 12 x layers x hidden x seq_len, with N the parameters that take
part in matmuls (all but the input embedding); the attention term is not halved for causality. MFU = achieved
FLOP/s / `--peak-tflops` (989 = H100/H200 SXM dense bf16).

    python benchmarks/gpu_throughput.py                                     # on the GPU machine
    python benchmarks/gpu_throughput.py --micro-batch 4 --seq-len 4096 --gradient-checkpointing
    python benchmarks/gpu_throughput.py --preset tiny --dtype float32 --steps 3 --warmup 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

PRESETS = {
    # TinyLlama-1.1B's shape
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096},
    # for checking the script on a CPU machine
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 104, "max_position_embeddings": 256},
}


def flops_per_token(config, matmul_params: int, seq_len: int) -> float:
    return 6.0 * matmul_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense peak for --dtype")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step pays one-time costs: allocation, kernels)")

    benchlib.single_thread_env(cpu=False)  # before torch: one CPU thread per process, offline, quiet
    import os

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # CPU smoke run; read when deepspeed is imported
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hpc_rlhf.config import TrainSection
    from hpc_rlhf.dist.bootstrap import init_distributed
    from hpc_rlhf.engines.train import TrainEngine

    init_distributed("auto")  # nccl on a GPU, gloo otherwise; one rank
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(**PRESETS[args.preset], use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:  # initialise on the GPU: a 1B model initialised by one CPU thread takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    matmul_params = params - model.get_input_embeddings().weight.numel()
    train_cfg = TrainSection(lr=1e-4, warmup_steps=0, max_steps=args.warmup + args.steps, min_lr_ratio=1.0,
                             micro_batch_size=args.micro_batch, batch_size=args.micro_batch * args.grad_accum,
                             zero_stage=args.zero_stage, max_grad_norm=1.0)
    engine = TrainEngine(model, train_cfg, group=None, model_dtype=dtype)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    generator = torch.Generator(device=device).manual_seed(0)
    clock = benchlib.StepClock()
    for _ in range(args.warmup + args.steps):
        for _ in range(args.grad_accum):
            input_ids = torch.randint(config.vocab_size, (args.micro_batch, args.seq_len), device=device,
                                      generator=generator)
            loss = engine(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
        sync()
        clock.tick()
    steps, seconds = clock.steady(args.warmup)
    tokens_per_s = steps * args.grad_accum * args.micro_batch * args.seq_len / seconds
    tflops = flops_per_token(config, matmul_params, args.seq_len) * tokens_per_s / 1e12
    where = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"device: {where}; {benchlib.versions()}")
    print(f"model: Llama preset {args.preset}, {params / 1e6:,.1f}M parameters, {args.dtype}, attn {args.attn}, "
          f"ZeRO-{args.zero_stage}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"batch: {args.micro_batch} x {args.seq_len} tokens x {args.grad_accum} accumulation; "
          f"{steps} timed steps after {args.warmup}")
    rows = [["optimizer steps/s", steps / seconds], ["tokens/s", tokens_per_s], ["model TFLOP/s", tflops],
            ["MFU (vs %g TFLOP/s)" % args.peak_tflops, tflops / args.peak_tflops]]
    if on_gpu:
        rows.append(["peak memory (GiB)", torch.cuda.max_memory_allocated() / 2**30])
    print(benchlib.table(["figure", "value"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
