"""Token log-probabilities, entropy and masked reductions: the tensor utilities every loss is built from.

Conventions shared by the whole `algorithms` package:
- `logits[..., t, :]` scores `labels[..., t]`: the caller shifts (`logits[:, :-1]` against `input_ids[:, 1:]`).
- A mask has the shape of the tensor it masks and marks the tokens that count (bool, or float 0/1). Values at
  masked-out positions are never read, so they may hold padding garbage, even NaN or inf.
- A reduction over nothing (an all-masked row, an empty batch) is 0, not NaN, so a batch with an empty response
  neither poisons the loss nor the gradients.
"""

from __future__ import annotations

import math

import torch

# Elements (tokens x vocabulary) handled at once by the chunked log-softmax. 2**24 fp32 values are 64 MiB: big
# enough that every chunk is one large kernel, small enough that a 150k vocabulary does not double the memory.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def _check_shapes(**named: torch.Tensor) -> None:
    """Raise one ValueError naming every argument whose shape differs from the first one's."""
    items = list(named.items())
    first_name, first = items[0]
    wrong = [f"{name} {tuple(t.shape)}" for name, t in items[1:] if t.shape != first.shape]
    if wrong:
        raise ValueError(f"shape mismatch: {first_name} has shape {tuple(first.shape)} but " + ", ".join(wrong))


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # Log-softmax in bf16/fp16 loses too much precision over a large vocabulary; fp64 stays fp64 (gradcheck).
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _seq_chunks(logits: torch.Tensor, chunk_elements: int):
    """(start, length) slices along the sequence dim (-2) so that each chunk holds about `chunk_elements`."""
    seq_len, vocab = logits.shape[-2], logits.shape[-1]
    rows_per_position = max(1, math.prod(logits.shape[:-2]))
    step = max(1, chunk_elements // (vocab * rows_per_position))
    for start in range(0, seq_len, step):
        yield start, min(step, seq_len - start)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[label], computed chunk by chunk.

    Autograd through `log_softmax` would keep a full (tokens x vocab) float tensor alive until backward, and
    for bf16 logits a second one (the upcast). Here the forward keeps only the per-token logsumexp, and the
    backward rebuilds the softmax one chunk at a time: d logp / d z_v = (1[v == label] - softmax_v) / T.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_elements):
        compute = _compute_dtype(logits)
        logps = torch.empty(labels.shape, dtype=compute, device=logits.device)
        logsumexp = torch.empty_like(logps)
        for start, length in _seq_chunks(logits, chunk_elements):
            chunk = logits.narrow(-2, start, length).to(compute)
            if temperature != 1.0:
                chunk = chunk / temperature
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            chunk_labels = labels.narrow(-1, start, length).unsqueeze(-1)
            logps.narrow(-1, start, length).copy_(chunk.gather(-1, chunk_labels).squeeze(-1) - chunk_lse)
            logsumexp.narrow(-1, start, length).copy_(chunk_lse)
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        logits, labels, logsumexp = ctx.saved_tensors
        temperature = ctx.temperature
        compute = logsumexp.dtype
        grad_logits = torch.empty_like(logits)
        for start, length in _seq_chunks(logits, ctx.chunk_elements):
            chunk = logits.narrow(-2, start, length).to(compute)
            if temperature != 1.0:
                chunk = chunk / temperature
            grad_out = grad_logps.narrow(-1, start, length).unsqueeze(-1).to(compute)
            # softmax * (-grad), then +grad at the label: built in place on the chunk copy.
            chunk_grad = (chunk - logsumexp.narrow(-1, start, length).unsqueeze(-1)).exp_().mul_(-grad_out)
            chunk_grad.scatter_add_(-1, labels.narrow(-1, start, length).unsqueeze(-1), grad_out)
            if temperature != 1.0:
                chunk_grad.div_(temperature)
            grad_logits.narrow(-2, start, length).copy_(chunk_grad)
        return grad_logits, None, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                   chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Log-probability of each label token: log softmax(logits / temperature)[label].

    logits (..., seq, vocab), labels (..., seq) of token ids in [0, vocab) -> (..., seq), in fp32 (fp64 for
    fp64 logits) whatever the logits' dtype. `temperature` must be the sampling temperature when these
    log-probs are compared with those of the rollout engine, which samples from softmax(logits / T).
    Padding positions need a valid id (e.g. the pad id), not -100: mask them afterwards.
    Memory: beyond the result, only one chunk of `chunk_elements` floats exists at a time, in forward and in
    backward; the gradient is differentiable in the logits only.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be (..., seq, vocab), got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits shape "
                         f"{tuple(logits.shape)} without its vocabulary dim")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels.numel() == 0:
        return torch.zeros(labels.shape, dtype=_compute_dtype(logits), device=logits.device)
    vocab = logits.shape[-1]
    # One host sync per call, negligible next to the forward pass, and it turns a CUDA device-side assert
    # (which kills the process without saying where) into an error that says what is wrong.
    low, high = torch.aminmax(labels)
    if low.item() < 0 or high.item() >= vocab:
        raise ValueError(f"labels must be token ids in [0, {vocab}), got values in [{low.item()}, {high.item()}] "
                         f"(mask padding/prompt tokens with a mask, not with -100)")
    return _TokenLogProbs.apply(logits, labels.long(), float(temperature), int(chunk_elements))


def entropy_from_logits(logits: torch.Tensor, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Entropy of softmax(logits) per position, in nats: H = logsumexp(z) - sum_v softmax(z)_v * z_v.

    logits (..., seq, vocab), finite -> (..., seq) in fp32 (fp64 for fp64 logits). Computed chunk by chunk along the
    sequence so that, without autograd (the usual case: entropy is logged), only one chunk is upcast at a time.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be (..., seq, vocab), got shape {tuple(logits.shape)}")
    compute = _compute_dtype(logits)
    pieces = []
    for start, length in _seq_chunks(logits, chunk_elements):
        chunk = logits.narrow(-2, start, length).to(compute)
        probs = torch.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=compute, device=logits.device)
    return torch.cat(pieces, dim=-1)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_i mask_i * x_i over `dim` (all elements when None). Masked-out entries may be NaN/inf."""
    _check_shapes(x=x, mask=mask)
    # masked_fill before multiplying: 0 * NaN would be NaN, and its gradient too.
    weighted = x.masked_fill(mask == 0, 0) * mask.to(x.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_i mask_i * x_i / sum_i mask_i over `dim` (all elements when None); 0 where the mask is empty."""
    total = masked_sum(x, mask, dim)
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the masked entries of x to unit variance: (x - mu) / sqrt(var + eps).

    mu and var are the mean and the population (biased) variance over all masked entries together, which is
    defined for a single entry too (it whitens to 0). With shift_mean=False the mean is kept:
    (x - mu) / sqrt(var + eps) + mu, the form used to rescale rewards without moving their level.
    Masked-out positions come back as 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.masked_fill(mask == 0, 0)


def sequence_logprob(token_logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """log pi(y|x) of each response: the sum of its masked token log-probs, (batch, seq) -> (batch,).

    average=True divides by the response length instead (the length-normalised log-prob that IPO and SimPO
    use, so that long answers are not penalised just for being long).
    """
    if average:
        return masked_mean(token_logps, mask, dim=-1)
    return masked_sum(token_logps, mask, dim=-1)
