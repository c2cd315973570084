"""Weight-sync bandwidth: hpc_rlhf's bucketed send_weights/receive_weights against plain broadcasts.

Three gloo ranks (torchrun, one thread each): rank 0 holds ~40 MB of fp32 weights named and shaped like a
small Llama (hidden 320, 4 layers, vocabulary 8000: 10.1M parameters); ranks 1 and 2 hold a model of the same
shapes and load what they receive into it. Methods, all over the whole 3-rank group:

  bucketed N MB   hpc_rlhf.dist.weight_sync.send_weights with bucket_mb=N and reuse_layout, as the RL trainer
                  calls it (tensors packed into buffers reused between syncs, a full bucket sent asynchronously
                  while the next is packed, tensors of a bucket's size or of 4 MB or more sent straight from
                  their storage; after the warm-up sync, one header per sync and the payloads alone) and
                  `receive_into` on the receivers,
                  as the hf engine does: each bucket arrives in a buffer the receiver keeps and its tensors stay
                  there as the receiver's weights, rewritten in place by the next sync (no copy out)
  ..., copied     the same sender; the receivers' load_fn copies every view into its own tensor of that name
                  (what the vLLM engine's loader does)
  per tensor      one dist.broadcast per tensor, straight into the receiver's tensor (no copies; the way
                  DESIGN §9 measured 0.6 GB/s)
  one flat        a single dist.broadcast of one flat tensor of the same bytes (the floor: no names, no
                  metadata, no copies)

Each repetition runs every method once, in a rotated order, each started after a barrier and timed until the
last rank finishes (max over ranks). GB/s = model bytes / median seconds (each receiver gets all the bytes);
the ratios are medians of the per-repetition ratios.
The received weights (every receiver's, copied and kept) are checked against the sender's after a warm-up run
of every method.

    .venv/bin/python benchmarks/weight_sync.py
    .venv/bin/python benchmarks/weight_sync.py --buckets 0.5 2 8 32 128 --repeats 9
    .venv/bin/python benchmarks/weight_sync.py --smoke     # does it run (the suite's smoke run): no figures to keep
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SMOKE = ["--buckets", "1", "--copied", "1", "--repeats", "1", "--ranks", "2"]

benchlib.single_thread_env()

SHAPES_CONFIG = {"hidden_size": 320, "intermediate_size": 864, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "vocab_size": 8000, "tie_word_embeddings": False}


def llama_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the benchmark-sized Llama, built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES_CONFIG))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


# ------------------------------------------------------------------------------------------------ worker
def worker(result_file: Path, buckets: list[float], copied: list[float], repeats: int) -> int:
    import torch
    import torch.distributed as dist

    from hpc_rlhf.dist.bootstrap import init_distributed
    from hpc_rlhf.dist.weight_sync import receive_into, receive_weights, send_weights

    benchlib.set_torch_threads()
    init_distributed("gloo")
    rank = dist.get_rank()
    src = 0
    generator = torch.Generator().manual_seed(0)
    # The sender's weights are random; receivers start from zeros so the check below means something.
    weights = {name: (torch.randn(shape, generator=generator) if rank == src else torch.zeros(shape))
               for name, shape in llama_shapes()}
    total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    flat = torch.randn(total_bytes // 4, generator=generator) if rank == src else torch.empty(total_bytes // 4)

    def load(pairs):
        for name, view in pairs:
            weights[name].copy_(view)

    class Receiver:  # what receive_into needs of an engine that keeps the buckets (hpc_rlhf's hf engine)
        def __init__(self):
            self.model = torch.nn.Module()
            for i, (name, shape) in enumerate(llama_shapes()):
                self.model.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
            self.by_name = dict(zip(weights, self.model.parameters()))
            self.received_buffers = []

        def adopt_weights(self, pairs):
            for name, view in pairs:
                self.by_name[name].data = view
            return {id(self.by_name[name]) for name, _ in pairs}

    receivers = {b: Receiver() for b in buckets} if rank != src else {}  # built once: not part of a sync

    def bucketed(bucket_mb, kept: bool):
        def run():
            if rank == src:
                send_weights(iter(weights.items()), src=src, group=None, bucket_mb=bucket_mb, reuse_layout=True)
            elif kept:
                receive_into(receivers[bucket_mb], src=src, group=None)
            else:
                receive_weights(src=src, group=None, load_fn=load)
        return run

    def per_tensor():
        for tensor in weights.values():
            dist.broadcast(tensor, src=src)

    def one_flat():
        dist.broadcast(flat, src=src)

    methods = {f"bucketed {b:g} MB": bucketed(b, kept=True) for b in buckets}
    methods.update({f"bucketed {b:g} MB, copied": bucketed(b, kept=False) for b in copied})
    methods["per tensor"] = per_tensor
    methods["one flat"] = one_flat
    names = list(methods)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # done when the slowest rank is done
        return float(elapsed.item())

    for name in names:  # warm-up: first-use costs (gloo buffers, allocator, kept buffers) stay out of the figures
        timed(methods[name])
    # received == sent, for the copying receivers and for every keeping one
    checks = (1 if copied else 0) + len(buckets)
    kept = [list(r.model.parameters()) for _, r in sorted(receivers.items())]
    held = [list(weights.values())] * checks if rank == src else ([list(weights.values())] if copied else []) + kept
    checksum = torch.tensor([sum(float(t.double().sum()) for t in tensors) for tensors in held], dtype=torch.float64)
    sums = [torch.zeros(checks, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    verified = all(torch.allclose(s, sums[src], rtol=1e-9, atol=0) for s in sums)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            seconds[name].append(timed(methods[name]))
    if rank == src:
        result_file.write_text(json.dumps({"bytes": total_bytes, "tensors": len(weights), "seconds": seconds,
                                           "verified": verified}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", nargs="+", type=float, default=[1, 4, 16, 64, 256], help="bucket sizes, MB")
    parser.add_argument("--copied", nargs="*", type=float, default=[16, 256],
                        help="bucket sizes also run with receivers that copy out of the buckets")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=3, help="1 sender + (ranks - 1) receivers")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help=f"that it runs, not a measurement: {' '.join(SMOKE)}, every rank forked from this "
                             "process (benchlib.run_ranks)")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*argv, *SMOKE])
    if args.worker:
        return worker(Path(args.worker), args.buckets, args.copied, args.repeats)
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")

    benchlib.header(f"Weight sync over {args.ranks} gloo ranks (1 sender, {args.ranks - 1} receivers), "
                    f"1 thread each")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        benchlib.run_ranks(args.ranks, Path(__file__).resolve(),
                           ["--worker", str(result_file), "--repeats", str(args.repeats),
                            "--buckets", *map(str, args.buckets), "--copied", *map(str, args.copied)],
                           "local" if args.smoke else "torchrun", main, what="weight-sync ranks", timeout=900)
        result = json.loads(result_file.read_text())
    size = result["bytes"]
    print(f"   payload: {result['tensors']} fp32 tensors, {size / 1e6:.1f} MB; {args.repeats} repeats, median; "
          f"received weights {'verified equal to the sender' if result['verified'] else 'DIFFER FROM THE SENDER'}")
    print(f"   machine after: {benchlib.machine_state()}\n")
    seconds = result["seconds"]
    rows = []
    for name, values in seconds.items():
        # a repetition runs every method once, back to back: ratios within one repetition share its load
        vs_flat = [f / v for f, v in zip(seconds["one flat"], values)]
        vs_tensor = [t / v for t, v in zip(seconds["per tensor"], values)]
        med = benchlib.median(values)
        rows.append([name, med * 1e3, benchlib.spread([v * 1e3 for v in values]), size / med / 1e9,
                     f"{benchlib.median(vs_flat):.2f}", f"{benchlib.median(vs_tensor):.2f}"])
    print(benchlib.table(["method", "ms (median)", "ms (min-max)", "GB/s", "vs one flat", "vs per tensor"], rows))
    print("\n   'vs' columns: speed relative to that method, median of the per-repetition ratios (above 1 = faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
