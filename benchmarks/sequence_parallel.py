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

On one GPU (`--device cuda`: one process, no torchrun, no process group): a block of one rank
(SequenceShard(None, 1, 0), whose exchanges are skipped) runs the same attention code as K ranks, so one GPU checks
the GPU path, flash-attention's varlen kernel over the samples' bounds (`_flash_varlen`), which K ranks cannot share
one GPU to check. One bf16 model of the shape above (attn_implementation flash_attention_2 where flash-attn imports;
else sdpa alone, said so, and exit 1 only under `--require-flash`), the same row through policy_forward as:
- packed, transformers' attention: the packed row without a sequence layout (transformers' own flash varlen path);
- sequence-parallel flash varlen: after `sequence_parallel.enable(model)`, the K = 1 sequence layout;
- packed, through enable()'s pass-through: the first again on the enabled model (forwards without a sequence
  layout should run transformers' attention unchanged); an error here is reported as a failure;
- sequence-parallel sdpa by sample: the same weights with the model's attention set to sdpa, enabled again (the
  CPU path).
It prints a markdown table of the max abs log-prob difference between them (response tokens), saved MB (as above)
and forward + backward ms (median of --repeats after one untimed), and exits 1 if the flash path's log-probs differ
from the packed flash forward's by more than TOLERANCE = 0.02. Why that bound: both run the same kernel on the same
bf16 inputs (the flash path repeats the key/value heads first), so 0 or bf16 rounding is expected; on CPU in bf16
(4 layers, 1,024 tokens) the two sdpa paths, which differ only in how attention is cut, came 5.8e-3 apart, and
attention leaking across the row's samples 1.1 apart. Not yet run on a GPU (none lent so far);
`benchmarks/gpu_checks.py` runs it (check "sequence parallel").

    .venv/bin/python benchmarks/sequence_parallel.py [--tokens 4096] [--ks 1 2 4] [--json]
    .venv/bin/python benchmarks/sequence_parallel.py --smoke     # does it run (the suite's smoke run)
    python benchmarks/sequence_parallel.py --device cuda [--tokens 16384] [--require-flash]     # one GPU
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


def llama_config(tokens: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, vocab_size=128, max_position_embeddings=tokens + 8,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def packed_row(tokens: int):
    """The 4 samples of the row (a quarter of the tokens each: a prompt of a quarter of that, the rest response)."""
    import torch

    from hpc_rlhf.rl.batches import make_batch  # here: torch loads after benchlib.single_thread_env's settings

    generator = torch.Generator().manual_seed(1)
    quarter = tokens // 4
    prompts = [torch.randint(3, 128, (quarter // 4,), generator=generator).tolist() for _ in range(4)]
    responses = [torch.randint(3, 128, (quarter - quarter // 4,), generator=generator) for _ in range(4)]
    return make_batch(prompts, responses, pad_id=0)


def forward_backward(model, sub, layout, sync=lambda: None):
    """The row's log-probs (detached), the bytes autograd saved for the backward (each storage once, the weights
    left out) and the seconds of the forward and backward."""
    import time

    import torch

    from hpc_rlhf.rl.packed import policy_forward  # as in packed_row

    saved: dict[tuple[int, int], int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved too, but no activation

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    sync()
    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, _ = policy_forward(model, sub, 1.0, layout)
    held = sum(saved.values())
    (logps * sub.action_mask[:, :logps.shape[1]].to(logps.device)).sum().backward()
    sync()
    return logps.detach(), held, time.perf_counter() - started


def worker(out: Path, tokens: int, layers: int) -> int:
    import dataclasses

    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from hpc_rlhf.models import sequence_parallel  # as in packed_row
    from hpc_rlhf.models.sequence_parallel import SequenceShard  # as in packed_row
    from hpc_rlhf.rl.packed import Layout  # as in packed_row

    benchlib.set_torch_threads()
    dist.init_process_group("gloo")
    rank, k = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(tokens, layers)).train()
    sub = packed_row(tokens)
    # The four samples in one row; K = 1 runs the same attention (by sample) without exchanges.
    sequence_parallel.enable(model)
    layout = dataclasses.replace(Layout(True, 0, tokens), sequence=SequenceShard(None, k, rank))
    logps, held, took = forward_backward(model, sub, layout)
    if rank == 0:
        out.write_text(json.dumps({"k": k, "saved_mb": held / 2**20, "fwd_bwd_s": took,
                                   "logps": logps.flatten().tolist()}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


TOLERANCE = 2e-2  # bf16 flash path against the plain packed one; the docstring says why


def flash_attention_missing() -> str | None:
    """Why flash-attn cannot run here (None: it imports). A wheel built for another torch fails at import."""
    try:
        import flash_attn  # noqa: F401  (GPU-only: never at module level)
    except (ImportError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def one_gpu(tokens: int, layers: int, repeats: int, require_flash: bool, device: str = "cuda") -> int:
    """The attention of a block of one rank (SequenceShard(None, 1, 0): no exchanges, no process group) on one
    GPU: flash-attention's varlen kernel over the samples (the GPU path), one sdpa call per sample (the CPU path)
    and the plain packed forward (transformers' own attention over the packed row), one bf16 model. `device`
    "cpu" runs the sdpa half of it here (no command-line flag: for trying the code without a GPU)."""
    import dataclasses
    import statistics

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print(f"sequence_parallel: --device cuda needs a CUDA GPU and this torch ({torch.__version__}) sees none; "
              "without --device the benchmark measures K = 1, 2, 4 ranks on CPU", file=sys.stderr)
        return 2
    from transformers import LlamaForCausalLM

    from hpc_rlhf.models import sequence_parallel  # as in packed_row
    from hpc_rlhf.models.sequence_parallel import SequenceShard  # as in packed_row
    from hpc_rlhf.rl.packed import Layout  # as in packed_row

    missing = flash_attention_missing()
    if missing:
        print(f"flash-attn does not import ({missing}): the flash path is not checked, sdpa runs instead",
              file=sys.stderr if require_flash else sys.stdout, flush=True)
        if require_flash:
            return 1
    attention = "sdpa" if missing else "flash_attention_2"
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(llama_config(tokens, layers), attn_implementation=attention,
                                          dtype=torch.bfloat16).to(device).train()
    sub = packed_row(tokens).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    packed = Layout(True, 0, tokens)
    one_rank = dataclasses.replace(packed, sequence=SequenceShard(None, 1, 0))

    def measure(layout) -> dict:
        logps, held, _ = forward_backward(model, sub, layout, sync)  # the first: kernels' start-up, not timed
        times = [forward_backward(model, sub, layout, sync)[2] for _ in range(repeats)]
        return {"logps": logps.float(), "saved_mb": held / 2**20, "ms": 1e3 * statistics.median(times)}

    runs = {f"packed, transformers' {attention}": measure(packed)}
    sequence_parallel.enable(model)
    failures = []
    if not missing:
        runs["sequence-parallel flash varlen"] = measure(one_rank)
        # A forward without a sequence layout on an enabled model should run transformers' flash attention
        # unchanged (a role's forwards outside the sharded step); a failure is a finding, not the end of the check.
        try:
            runs["packed, through enable()'s pass-through"] = measure(packed)
        except Exception as error:  # noqa: BLE001  (reported below with the others' figures)
            failures.append(f"the packed forward through enable()'s pass-through raised "
                            f"{type(error).__name__}: {str(error)[:200]}")
    model.config._attn_implementation = "sdpa"  # the same weights through the per-sample sdpa wrapper
    sequence_parallel.enable(model)
    runs["sequence-parallel sdpa by sample"] = measure(one_rank)
    plain = next(iter(runs))
    mask = sub.action_mask[:, :runs[plain]["logps"].shape[1]].bool()

    def gap(a: str, b: str) -> float:
        return float((runs[a]["logps"] - runs[b]["logps"]).abs()[mask].max())

    others = [name for name in runs if name != plain]
    print(f"one packed row of {tokens} tokens (4 samples), Llama hidden {SHAPE['hidden_size']}, "
          f"{SHAPE['num_attention_heads']} heads ({SHAPE['num_key_value_heads']} key/value), {layers} layers; bf16 on "
          f"{torch.cuda.get_device_name(0) if device == 'cuda' else device}, torch {torch.__version__}; a block of "
          f"one rank (K = 1); ms: median of {repeats} forward + backward after one untimed")
    print(f"| attention | max abs log-prob difference to {plain} | to sequence-parallel sdpa by sample | saved MB "
          "| forward + backward ms |")
    print("|---|---|---|---|---|")
    for name in runs:
        to_plain = f"{gap(name, plain):.2e}" if name != plain else ""
        to_sdpa = f"{gap(name, others[-1]):.2e}" if name != others[-1] else ""
        print(f"| {name} | {to_plain} | {to_sdpa} | {runs[name]['saved_mb']:.1f} | {runs[name]['ms']:.1f} |")
    if missing:
        print("flash path: not run (flash-attn does not import)")
        return 0
    flash_gap = gap("sequence-parallel flash varlen", plain)
    if flash_gap > TOLERANCE:
        failures.append(f"the flash path's log-probs differ from the packed flash forward's by {flash_gap:.2e} "
                        f"(tolerance {TOLERANCE:g})")
    print(f"flash path against the packed flash forward: max abs log-prob difference {flash_gap:.2e} (tolerance "
          f"{TOLERANCE:g}); {'ok' if not failures else f'{len(failures)} failure(s)'}", flush=True)
    for failure in failures:  # last on stderr: the line gpu_checks.py reports for a failed check
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the packed row")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", action="store_true", help="last line: the figures as one JSON object")
    parser.add_argument("--smoke", action="store_true", help="that it runs: 64 tokens, 1 layer, K = 1 and 2")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one process on one GPU, a block of one rank, flash-attention's path against "
                             "the per-sample sdpa one and the plain packed forward (bf16); --ks does not apply")
    parser.add_argument("--repeats", type=int, default=5, help="--device cuda: timed forward + backward passes")
    parser.add_argument("--require-flash", action="store_true",
                        help="--device cuda: exit 1 when flash-attn does not import (else sdpa runs alone)")
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "TOKENS", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker[0]), int(args.worker[1]), int(args.worker[2]))
    if args.device == "cuda":
        if args.tokens % 4:
            parser.error("--tokens must be a multiple of 4 (the row's samples)")
        if args.smoke:
            return one_gpu(64, 1, 1, args.require_flash)
        return one_gpu(args.tokens, SHAPE["num_hidden_layers"], args.repeats, args.require_flash)
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
