"""Activation memory per rank of sequence parallelism (placement keys `<kind>_sp=K`): one packed row of a few long
samples through the actor's forward and backward (hpc_rlhf.rl.packed.policy_forward, the RL step's training
forward) on a world of K ranks sharing the row, for K = 1, 2 and 4, each a fresh torchrun world.

What is measured, per rank:
- saved_mb: the bytes autograd holds for the backward at the end of the forward (every tensor saved by an
  operation, through torch.autograd.graph.saved_tensors_hooks, each storage counted once, the weights left out):
  the activations, which sequence parallelism divides. Exact, and independent of the machine's load: one run per
  K is enough. Attention runs by sample for every K (hpc_rlhf/models/sequence_parallel.py), K = 1 without
  exchanges, so that the rows compare like with like.
- max_logp_gap: the largest difference of the row's log-probs from K = 1's (float rounding only).
- fwd_bwd_s: the time of the forward and backward (K ranks share this machine's cores: no speed figure).

The model: a random-init Llama of hidden 256, 8 heads (4 key/value heads), 4 layers, the shipped tokenizer's
vocabulary; the row: 4 samples of the given total length (default 4096 tokens) with their positions restarting.

    .venv/bin/python benchmarks/sequence_parallel.py [--tokens 4096] [--ks 1 2 4] [--json]
    .venv/bin/python benchmarks/sequence_parallel.py --smoke     # does it run (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)


def worker(out: Path, tokens: int, layers: int) -> int:
    import dataclasses
    import time

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.models import sequence_parallel
    from hpc_rlhf.models.sequence_parallel import SequenceShard
    from hpc_rlhf.rl.batches import make_batch
    from hpc_rlhf.rl.packed import Layout, policy_forward

    benchlib.set_torch_threads()
    dist.init_process_group("gloo")
    rank, k = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, vocab_size=128,
                         max_position_embeddings=tokens + 8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    generator = torch.Generator().manual_seed(1)
    quarter = tokens // 4
    prompts = [torch.randint(3, 128, (quarter // 4,), generator=generator).tolist() for _ in range(4)]
    responses = [torch.randint(3, 128, (quarter - quarter // 4,), generator=generator) for _ in range(4)]
    sub = make_batch(prompts, responses, pad_id=0)
    # The four samples in one row; K = 1 runs the same attention (by sample) without exchanges.
    sequence_parallel.enable(model)
    layout = dataclasses.replace(Layout(True, 0, tokens), sequence=SequenceShard(None, k, rank))

    saved: dict[tuple[int, int], int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved too, but no activation

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, _ = policy_forward(model, sub, 1.0, layout)
    held = sum(saved.values())
    (logps * sub.action_mask[:, :logps.shape[1]]).sum().backward()
    took = time.perf_counter() - started
    if rank == 0:
        out.write_text(json.dumps({"k": k, "saved_mb": held / 2**20, "fwd_bwd_s": took,
                                   "logps": logps.detach().flatten().tolist()}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the packed row")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", action="store_true", help="last line: the figures as one JSON object")
    parser.add_argument("--smoke", action="store_true", help="that it runs: 64 tokens, 1 layer, K = 1 and 2")
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "TOKENS", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker[0]), int(args.worker[1]), int(args.worker[2]))
    benchlib.single_thread_env()
    tokens, layers, ks = args.tokens, SHAPE["num_hidden_layers"], args.ks
    if args.smoke:
        tokens, layers, ks = 64, 1, [1, 2]
    if tokens % (4 * max(ks)):
        parser.error(f"--tokens must be a multiple of 4 x the largest K ({4 * max(ks)})")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_sp_") as tmp:
        for k in ks:
            out = Path(tmp) / f"k{k}.json"
            benchlib.run_ranks(k, __file__, ["--worker", str(out), str(tokens), str(layers)],
                               "local" if args.smoke else "torchrun", main, what=f"K={k}")
            rows.append(json.loads(out.read_text()))
    base = rows[0]
    print(f"one packed row of {tokens} tokens (4 samples), Llama hidden {SHAPE['hidden_size']}, "
          f"{SHAPE['num_attention_heads']} heads, {layers} layers; fp32, one thread per rank")
    print("| K | saved MB per rank | x of K = 1 | max abs log-prob difference to K = 1 | forward + backward s |")
    print("|---|---|---|---|---|")
    figures = []
    for row in rows:
        gap = max(abs(a - b) for a, b in zip(row["logps"], base["logps"], strict=True))
        figures.append({"k": row["k"], "saved_mb": round(row["saved_mb"], 2),
                        "ratio": round(row["saved_mb"] / base["saved_mb"], 3), "max_logp_gap": gap,
                        "fwd_bwd_s": round(row["fwd_bwd_s"], 2)})
        print(f"| {row['k']} | {row['saved_mb']:.1f} | {row['saved_mb'] / base['saved_mb']:.3f} | {gap:.2e} | "
              f"{row['fwd_bwd_s']:.2f} |")
    if args.json:
        print(json.dumps({"tokens": tokens, "layers": layers, "rows": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
