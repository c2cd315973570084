"""Padding-free RL forwards (rl.padding_free): on a batch of long-tailed sample lengths, the actor's log-probs on
padded rows against packed ones (rows as long as the longest sample, and one row per micro-batch), with the
largest difference between the layouts, the pad share and the time of a forward and backward in each, alternated
round by round in one process.

On a GPU with flash-attn installed the packed layouts run flash-attention's varlen kernel (the padded one sdpa);
elsewhere all three run sdpa. `benchmarks/gpu_checks.py` runs it on the GPU machine.

    .venv/bin/python benchmarks/rl_packing.py                         # CPU, the benchmark Llama, one thread
    python benchmarks/rl_packing.py --device cuda --dtype bfloat16    # GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def long_tailed_batch(samples: int, vocab: int, seed: int):
    """Prompts and responses whose lengths follow a log-normal law (median 24 and 48 tokens, a few ten times
    longer), as in reasoning and tool episodes."""
    import torch

    from hpc_rlhf.rl.batches import make_batch

    generator = torch.Generator().manual_seed(seed)
    def length(median: float, most: int) -> int:
        return int(min(most, max(2, median * torch.empty(1).log_normal_(0, 0.8, generator=generator).item())))
    prompts = [torch.randint(3, vocab, (length(24, 256),), generator=generator).tolist() for _ in range(samples)]
    responses = [torch.randint(3, vocab, (length(48, 512),), generator=generator) for _ in range(samples)]
    return make_batch(prompts, responses, pad_id=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--samples", type=int, default=16, help="samples in the micro-batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="that it runs, not a measurement: 2 samples, 1 round, a 2-layer model of width 64")
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples, args.rounds = 2, 1
    if args.device == "cpu":
        benchlib.single_thread_env()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.rl.metrics import pad_share
    from hpc_rlhf.rl.packed import PADDED, Layout, policy_forward

    flash = args.device != "cpu" and importlib.util.find_spec("flash_attn") is not None
    dtype = getattr(torch, args.dtype)
    width, ffn, layers = (64, 172, 2) if args.smoke else (256, 688, 4)
    config = LlamaConfig(hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024)
    torch.manual_seed(0)
    models = {"sdpa": LlamaForCausalLM(config).to(args.device, dtype)}
    if flash:
        models["flash_attention_2"] = LlamaForCausalLM._from_config(config, attn_implementation="flash_attention_2")
        models["flash_attention_2"].load_state_dict(models["sdpa"].state_dict())
        models["flash_attention_2"].to(args.device, dtype)
    packed_model = models["flash_attention_2" if flash else "sdpa"]
    batch = long_tailed_batch(args.samples, config.vocab_size, seed=0).to(args.device)
    layouts = {"padded": (models["sdpa"], PADDED), "packed, longest-sample rows": (packed_model, Layout(True, 0, 0)),
               "packed, one row": (packed_model, Layout(True, 0, 1 << 20))}
    mask = batch.action_mask.to(args.device)
    reference, _ = policy_forward(models["sdpa"], batch, 1.0, PADDED)
    times = {name: [] for name in layouts}
    differences = {}
    for _ in range(args.rounds):
        for name, (model, layout) in layouts.items():
            start = time.perf_counter()
            logps, _ = policy_forward(model, batch, 1.0, layout)
            (logps * mask).sum().backward()
            if args.device != "cpu":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            differences[name] = float(((logps.detach() - reference.detach()).abs() * mask).max())
            model.zero_grad(set_to_none=True)
    print(f"# {args.samples} samples, {int(mask.sum())} response tokens, {args.device} {args.dtype}, packed "
          f"attention: {'flash_attention_2 varlen' if flash else 'sdpa'}")
    print("| layout | pad share | max abs logp difference to padded | forward+backward s (median) | vs padded |")
    print("|---|---|---|---|---|")
    padded_s = statistics.median(times["padded"])
    for name, (_, layout) in layouts.items():
        seconds = statistics.median(times[name])
        print(f"| {name} | {pad_share(batch, args.samples, layout):.3f} | {differences[name]:.2e} | {seconds:.4f} | "
              f"{padded_s / seconds:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
