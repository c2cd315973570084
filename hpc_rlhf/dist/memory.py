"""Per-rank GPU memory estimate for each role of a placement. Pure Python: no torch.

Memory model (GB = 10^9 bytes; P = parameters of the role's model; N = ranks of the role)
-----------------------------------------------------------------------------------------
Parameters are counted from the shape (embeddings, attention with grouped KV heads, gated MLP per expert,
router, RMSNorms, LM head unless tied). Value models (critic, reward) replace the LM head by a scalar head.

Training roles (actor, critic), mixed-precision Adam, 16 bytes per parameter before sharding (d = the training
dtype's bytes: 2 for bf16 on GPU, the default; 4 for fp32, as on CPU: 20 bytes per parameter):
    weights      d bytes/param                 / N under ZeRO-3
    gradients    d bytes/param                 / N under ZeRO-2 and 3
    optimizer   12 bytes/param (fp32 master weights, Adam m and v) / N under ZeRO-1, 2 and 3 (DeepSpeed keeps
                 the fp32 master partition apart even when training in fp32);
                 with Adam offload these live in CPU memory (reported as `cpu_optimizer`), not on the GPU.
ZeRO-3's working set, on top of the shards (measured: benchmarks/memory_scaling.py): the module being run,
whole (the largest: an embedding, LM head or MLP projection), plus DeepSpeed's window of parameters gathered
ahead or kept for reuse (counted under weights), and its bucket of full-size gradients before they are
reduce-scattered, twice when the role has several ranks (the reduce-scatter packs it once more; under
gradients); window and bucket are `ZERO3_WINDOW_SHARE` of the model, at most 1e9 and 5e8 parameters (what
engines/train.py configures, with the optimizer stepping over sub-groups of that size, whose temporaries stay
within the allowance for activations).
Inference roles (ref, reward): d-byte weights, sharded (/ N) only under ZeRO-3, plus the largest module and the
window under ZeRO-3.
Rollout engines of `tp` ranks: bf16 weights / tp, plus the KV cache of the tokens an engine holds at once:
    2 (K and V) * layers * kv_heads * head_dim * 2 bytes per token, the KV heads split over tp
    (a KV head is replicated when tp > kv_heads, as vLLM does).
Activation allowance (b = micro batch, s = sequence length, h = hidden, L = layers, V = vocab):
    one transformer layer's working set is taken as 34 * b * s * h bytes (16-bit activations with a fused
    attention kernel, which keeps no s x s score matrix; Korthikanti et al. 2022), twice that in fp32;
    training keeps that for every layer, or with gradient checkpointing one bf16 hidden state per layer
    (2 * b * s * h * L) plus one layer being recomputed;
    roles that produce token log-probs (actor, ref) add fp32 logits, 4 * b * s * V bytes, and the actor
    their gradient as well (8 * b * s * V in all);
    inference roles keep one layer's working set; rollout engines one layer's working set over a prefill
    chunk of `ROLLOUT_PREFILL_TOKENS` tokens, split over tp.
Sequence parallel (`<kind>_sp` = K > 1 for a trained or scoring role): K ranks share one packed row, each holding
    s / K of its tokens through the layers; attention, after an all-to-all of q, k and v, holds H / K heads of the
    whole row, the same number of elements. So every activation term above is taken over b * s / K tokens. Added
    on top, the all-to-all's buffers, stated as an estimate: one layer's q, k, v and attention output of the local
    chunk, d * (b * s / K) * (2 * H + 2 * KV) * head_dim bytes (what is sent and received around one attention);
    when K does not divide KV the key/value heads travel repeated to one per query head (hpc_rlhf/models/
    sequence_parallel.py), so KV counts as H there. The actor's weight-sync buffers do not shrink with K.
Overhead: a flat allowance per rank (`overhead_gb`, default 1 GB) for the CUDA context and allocator
fragmentation. NCCL's buffers are counted apart, per communicator the rank holds, by `hpc-rlhf plan`
(hpc_rlhf.scale.communicators), since their number depends on the placement (it was 2 GB before they were).
Roles colocated on the same ranks (`actor+ref`, `rollout@actor`) add up (`hpc-rlhf plan` sums them): the
estimate is the peak with every model resident, which is what happens while a hybrid vLLM engine generates
beside the actor's training state (the hybrid hf engine generates with the actor's own module and holds no
copy: an upper bound there).
LoRA actor (`lora_rank` r > 0 on `lora_targets`; A = the adapter's parameters, r x (in + out) per adapted
projection of every layer and expert): the frozen base keeps its d-byte weights (sharded under ZeRO-3), the
adapter adds d bytes per A; gradients and Adam states exist for the adapter alone (d + 12 bytes per A, sharded as
above; under ZeRO-3 DeepSpeed's gradient bucket fills with the adapter's gradients only, so at most A elements);
activations are those of full training (the gradient flows back through every frozen layer). The reference is
then the actor with its adapter off (no `ref` role, `ref_mode=adapter_disabled`): its scoring pass runs between
training passes and needs less than training's activations, so it adds nothing. The weight sync moves d bytes per
A, and the leader's two bucket buffers hold at most that. A rollout engine keeps the adapter beside its weights:
vLLM allocates one adapter slot of rank `max_lora_rank` (r rounded up to the ranks it offers) on every projection
of every layer, d bytes each (`lora_rank` given to a rollout estimate).
Host memory per rank (`host`, checked per node against the node's memory by hpc_rlhf.dist.allocation): with Adam
offload a training role's ranks keep DeepSpeed's CPU optimizer state, fp32 master weights, Adam m and v and the
fp32 gradient partition, 16 bytes per trained parameter / N in pinned host memory (`cpu_optimizer`: the 12 bytes
of master weights and moments); a vLLM engine that sleeps while the actor trains (hybrid placement, sleep level 1)
keeps its weights there, d bytes per parameter / tp; and every rank a flat `HOST_OVERHEAD_GB` for its process
(Python, torch's and CUDA's libraries and host buffers: an allowance, not measured by the project).
The actor's leader also holds the weight sync's two bucket buffers (`weight_sync_bucket_mb` each, when
given) while it streams the weights to the engines. The model ignores MoE expert activations (experts are
counted in the parameters, activations use the dense formula) and the communication buffers of ZeRO 1-2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
DEFAULT_OVERHEAD_GB = 1.0
HOST_OVERHEAD_GB = 4.0  # host memory of one rank's process besides what the model puts there (module docstring)
ROLLOUT_PREFILL_TOKENS = 8192  # vLLM's default chunked-prefill token budget
ACTIVATION_BYTES_PER_LAYER_TOKEN_HIDDEN = 34
TRAINING_KINDS = ("actor", "critic")
ZERO3_WINDOW_SHARE = 1 / 8  # engines/train.py: DeepSpeed's gathering window and gradient bucket, share of the model
ZERO3_WINDOW_MAX = 10**9  # parameters (stage3_max_live_parameters, stage3_max_reuse_distance)
ZERO3_GRADIENT_BUCKET_MAX = 5 * 10**8  # elements (reduce_bucket_size)
KINDS = ("actor", "critic", "ref", "teacher", "reward", "rollout")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # config.LoraSection's default
# The LoRA ranks vLLM 0.32 accepts as `max_lora_rank` (vllm/config/lora.py, MaxLoRARanks); an adapter of a rank up
# to it loads. Kept here, without importing vLLM, because it is checked before any rank starts (rl/config.py).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ModelShapeError(ValueError):
    """A model shape that cannot be read or makes no sense; the message names the file or field."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int  # MLP width of one expert (of the dense MLP for dense models)
    vocab: int
    tied_embeddings: bool = False
    experts: int = 1  # > 1: mixture of experts with a router per layer
    experts_per_token: int = 1
    head_dim: int | None = None  # None: hidden // heads
    attention_bias: bool = False  # biases on q, k, v (Qwen2)
    name: str = ""

    def __post_init__(self):
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "experts",
                    "experts_per_token"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelShapeError(f"model shape {self.name or ''}: '{key}' must be a positive integer, "
                                      f"got {value!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ModelShapeError(f"model shape {self.name}: hidden {self.hidden} is not divisible by "
                                  f"{self.heads} heads (give head_dim)")
        if self.heads % self.kv_heads:
            raise ModelShapeError(f"model shape {self.name}: {self.heads} heads are not divisible by "
                                  f"{self.kv_heads} KV heads")
        if self.experts_per_token > self.experts:
            raise ModelShapeError(f"model shape {self.name}: {self.experts_per_token} experts per token but "
                                  f"only {self.experts} experts")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    def _layer_params(self, experts: int) -> int:
        q_width, kv_width = self.heads * self.head_size, self.kv_heads * self.head_size
        attention = self.hidden * q_width + 2 * self.hidden * kv_width + q_width * self.hidden
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        mlp = experts * 3 * self.hidden * self.intermediate  # gate, up, down
        router = self.hidden * self.experts if self.experts > 1 else 0
        return attention + mlp + router + 2 * self.hidden  # two RMSNorms

    def params(self, lm_head: bool = True) -> int:
        """All parameters; `lm_head=False` for a value model (the LM head replaced by a scalar head)."""
        embeddings = self.vocab * self.hidden
        head = self.vocab * self.hidden if lm_head and not self.tied_embeddings else 0
        value_head = 0 if lm_head else self.hidden
        return embeddings + self.layers * self._layer_params(self.experts) + self.hidden + head + value_head

    @property
    def num_params(self) -> int:
        return self.params()

    @property
    def active_params(self) -> int:
        """Parameters used per token (differs from num_params only for mixture-of-experts models)."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.vocab * self.hidden + self.layers * self._layer_params(self.experts_per_token)
                + self.hidden + head)

    def largest_module(self, lm_head: bool = True) -> int:
        """Parameters of the largest single module (what ZeRO-3 gathers whole at once): the embedding or LM
        head, an MLP projection of one expert, or an attention projection."""
        q_width = self.heads * self.head_size
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * q_width)

    def lora_params(self, rank: int, targets=DEFAULT_LORA_TARGETS) -> int:
        """Parameters of a LoRA adapter of `rank` on the projections `targets` (names of PROJECTIONS) of every
        layer: rank x (in + out) per projection, per expert for the MLP's."""
        unknown = [t for t in targets if t not in PROJECTIONS]
        if unknown:
            raise ModelShapeError(f"LoRA targets {unknown} are not projections this memory model knows "
                                  f"({', '.join(PROJECTIONS)})")
        q_width, kv_width = self.heads * self.head_size, self.kv_heads * self.head_size
        sizes = {"q_proj": (self.hidden, q_width), "k_proj": (self.hidden, kv_width),
                 "v_proj": (self.hidden, kv_width), "o_proj": (q_width, self.hidden),
                 "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                 "down_proj": (self.intermediate, self.hidden)}
        per_layer = sum(rank * sum(sizes[t]) * (self.experts if t in PROJECTIONS[4:] else 1) for t in set(targets))
        return self.layers * per_layer

    def streamed_tensors(self) -> list[tuple[str, int]]:
        """(Hugging Face name, elements) of every weight of the causal LM in the order the weight sync streams them
        (models.lora.merged_tensors: module by module, as transformers 5 builds Llama, Qwen2 and Mixtral; a tied
        LM head is streamed under its own name too)."""
        h, q_width, kv_width = self.hidden, self.heads * self.head_size, self.kv_heads * self.head_size
        out = [("model.embed_tokens.weight", self.vocab * h)]
        for i in range(self.layers):
            layer = f"model.layers.{i}"
            for proj, rows in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
                out.append((f"{layer}.self_attn.{proj}.weight", rows * h))
                if self.attention_bias:
                    out.append((f"{layer}.self_attn.{proj}.bias", rows))
            out.append((f"{layer}.self_attn.o_proj.weight", h * q_width))
            if self.experts > 1:  # transformers 5 keeps the experts' weights fused, one tensor per projection
                out += [(f"{layer}.mlp.gate.weight", self.experts * h),
                        (f"{layer}.mlp.experts.gate_up_proj", self.experts * 2 * self.intermediate * h),
                        (f"{layer}.mlp.experts.down_proj", self.experts * h * self.intermediate)]
            else:
                out += [(f"{layer}.mlp.{proj}.weight", self.intermediate * h)
                        for proj in ("gate_proj", "up_proj", "down_proj")]
            out += [(f"{layer}.input_layernorm.weight", h), (f"{layer}.post_attention_layernorm.weight", h)]
        out.append(("model.norm.weight", h))
        out.append(("lm_head.weight", self.vocab * h))  # tied to the embeddings or not, it is streamed by name
        return out

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token on one rank of a tensor-parallel engine of `tp` ranks."""
        kv_heads_per_rank = math.ceil(self.kv_heads / tp)
        return 2 * self.layers * kv_heads_per_rank * self.head_size * dtype_bytes

    def to_config_json(self) -> dict[str, Any]:
        """This shape as a Hugging Face config.json (Llama, or Mixtral with experts): what a model on the meta
        device is built from for a preset (`hpc-rlhf simulate`). `from_config_json` reads it back unchanged."""
        config = {"model_type": "mixtral" if self.experts > 1 else "llama", "hidden_size": self.hidden,
                  "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                  "num_key_value_heads": self.kv_heads, "intermediate_size": self.intermediate,
                  "vocab_size": self.vocab, "tie_word_embeddings": self.tied_embeddings,
                  "attention_bias": self.attention_bias, "torch_dtype": "bfloat16"}
        if self.head_dim is not None:
            config["head_dim"] = self.head_dim
        if self.experts > 1:
            config |= {"num_local_experts": self.experts, "num_experts_per_tok": self.experts_per_token}
        return config

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        key = name.lower().removeprefix("llama-2-").removeprefix("llama2-")
        if key not in PRESETS:
            raise ModelShapeError(f"unknown model preset '{name}'; presets: {', '.join(PRESETS)} "
                                  f"(or a folder with a Hugging Face config.json)")
        return PRESETS[key]

    @classmethod
    def from_config_json(cls, path: str | Path) -> "ModelShape":
        """Read a Hugging Face config.json (llama, mistral, qwen2, mixtral and alike), or a folder holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelShapeError(f"model config '{path}' does not exist")
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelShapeError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ModelShapeError(f"{path}: the top level must be a JSON object")
        return cls.from_config(config, str(path), name=str(path.parent.name or config.get("model_type", "")))

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str, name: str = "") -> "ModelShape":
        """The shape of a Hugging Face config (the contents of a config.json; `where` names it in errors)."""
        path = where
        if "text_config" in config and "hidden_size" not in config:  # multimodal wrappers
            config = config["text_config"]

        def get(key: str, default: Any = None) -> Any:
            value = config.get(key, default)
            if value is None:
                raise ModelShapeError(f"{path}: missing key '{key}'")
            return value

        heads = get("num_attention_heads")
        experts = config.get("num_local_experts") or config.get("num_experts") or 1
        intermediate = config.get("moe_intermediate_size") if experts > 1 and "moe_intermediate_size" in config \
            else get("intermediate_size")
        model_type = config.get("model_type", "")
        try:
            return cls(hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
                       kv_heads=config.get("num_key_value_heads") or heads, intermediate=intermediate,
                       vocab=get("vocab_size"), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                       experts=experts, experts_per_token=config.get("num_experts_per_tok", 1) if experts > 1
                       else 1, head_dim=config.get("head_dim"),
                       attention_bias=bool(config.get("attention_bias", model_type.startswith("qwen2"))),
                       name=name or model_type)
        except ModelShapeError as exc:
            raise ModelShapeError(f"{path}: {exc}") from None


# Llama-2 shapes (7b, 13b, 70b) and CodeLlama-34B (Llama-2 family, grouped KV heads).
PRESETS = {
    "7b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000,
                     name="llama-2-7b"),
    "13b": ModelShape(hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824, vocab=32000,
                      name="llama-2-13b"),
    "34b": ModelShape(hidden=8192, layers=48, heads=64, kv_heads=8, intermediate=22016, vocab=32000,
                      name="codellama-34b"),
    "70b": ModelShape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=32000,
                      name="llama-2-70b"),
}


def vllm_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for adapters of `rank`: the smallest of VLLM_MAX_LORA_RANKS that holds it."""
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)


def load_shape(model: str | Path) -> ModelShape:
    """A preset name ('7b', 'llama-2-70b') or a path to a config.json or a model folder."""
    path = Path(model)
    if path.exists():
        return ModelShape.from_config_json(path)
    return ModelShape.preset(str(model))


def pass_tokens(micro_batch_size: int, seq_len: int, micro_batch_tokens: int = 0) -> int:
    """The most tokens one training or scoring pass of a rank holds: `micro_batch_size` samples of `seq_len`, or
    with a token budget (`micro_batch_tokens` > 0) the budget, or one sample of `seq_len` when that is longer."""
    return max(micro_batch_tokens, seq_len) if micro_batch_tokens else micro_batch_size * seq_len


def estimate(role_kind: str, shape: ModelShape, ranks: int, zero_stage: int = 0, adam_offload: bool = False, *,
             tp: int = 1, micro_batch_size: int = 1, seq_len: int = 2048, gradient_checkpointing: bool = True,
             micro_batch_tokens: int = 0, tokens_in_flight: int = 0, overhead_gb: float = DEFAULT_OVERHEAD_GB,
             dtype_bytes: int = 2,
             weight_sync_bucket_mb: float = 0.0, lora_rank: int = 0,
             lora_targets=DEFAULT_LORA_TARGETS, sleeps_on_host: bool = False,
             sequence_parallel: int = 1) -> dict[str, float]:
    """GB on each GPU of a role of `ranks` ranks, by component, with `total` (GPU) and `cpu_optimizer`
    (host memory per rank holding offloaded Adam states). See the module docstring for the model.

    `micro_batch_size` x `seq_len` is the batch of a training or scoring pass on one rank, or with
    `micro_batch_tokens` (micro-batches cut by a token budget, rl.micro_batch_tokens) that many tokens, or one
    sample of `seq_len` where the budget is smaller (a longer sample goes alone); `tp` and
    `tokens_in_flight` (tokens an engine keeps in its KV cache at once) apply to rollout only. `dtype_bytes`:
    2 (bf16/fp16, the default) or 4 (fp32). `weight_sync_bucket_mb`: the actor leader's two bucket buffers.
    `lora_rank` > 0: the actor trains a LoRA adapter on `lora_targets` (and a rollout engine serves it).
    `host`: host memory per rank for the model (offloaded optimizer, a sleeping engine's weights; without the
    process's own `HOST_OVERHEAD_GB`); `sleeps_on_host`: a rollout engine that moves its weights there.
    `sequence_parallel` K: ranks sharing one packed row (not for rollout: its engines split by `tp`)."""
    if role_kind not in KINDS:
        raise ValueError(f"unknown role kind '{role_kind}'; kinds: {', '.join(KINDS)}")
    if ranks < 1 or tp < 1 or micro_batch_size < 1 or seq_len < 1 or tokens_in_flight < 0 or micro_batch_tokens < 0:
        raise ValueError(f"ranks ({ranks}), tp ({tp}), micro_batch_size ({micro_batch_size}) and seq_len "
                         f"({seq_len}) must be at least 1, tokens_in_flight ({tokens_in_flight}) and "
                         f"micro_batch_tokens ({micro_batch_tokens}) at least 0")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if adam_offload and zero_stage == 0 and role_kind in TRAINING_KINDS:
        raise ValueError("Adam offload needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads sharded optimizer states)")
    if role_kind == "rollout" and ranks % tp:
        raise ValueError(f"{ranks} rollout ranks cannot form engines of tp={tp}")
    if sequence_parallel < 1 or (sequence_parallel > 1 and role_kind == "rollout"):
        raise ValueError(f"sequence_parallel must be at least 1, and 1 for rollout engines (they split by tp), got "
                         f"{sequence_parallel}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    if lora_rank < 0 or (lora_rank > VLLM_MAX_LORA_RANKS[-1] and role_kind == "rollout"):
        raise ValueError(f"LoRA rank must be >= 0 (and at most {VLLM_MAX_LORA_RANKS[-1]} for a vLLM engine), got "
                         f"{lora_rank}")

    value_model = role_kind in ("critic", "reward")
    params = shape.params(lm_head=not value_model)
    d = dtype_bytes
    # a rank's share of a row when K ranks split it (module docstring); rollout engines hold their own tokens
    tokens = pass_tokens(micro_batch_size, seq_len, micro_batch_tokens) / sequence_parallel
    layer_working_set = ACTIVATION_BYTES_PER_LAYER_TOKEN_HIDDEN * tokens * shape.hidden * d / 2
    kv_sent = shape.kv_heads if shape.kv_heads % sequence_parallel == 0 else shape.heads
    all_to_all = (d * tokens * (2 * shape.heads + 2 * kv_sent) * shape.head_size
                  if sequence_parallel > 1 else 0)
    out = dict(weights=0.0, gradients=0.0, optimizer=0.0, activations=0.0, kv_cache=0.0, overhead=overhead_gb,
               cpu_optimizer=0.0, host=0.0)
    window = min(ZERO3_WINDOW_MAX, int(params * ZERO3_WINDOW_SHARE))
    gathered = shape.largest_module(lm_head=not value_model) + window if zero_stage >= 3 else 0

    lora = shape.lora_params(lora_rank, lora_targets) if lora_rank > 0 and role_kind == "actor" else 0
    if role_kind in TRAINING_KINDS:
        trained = lora or params  # a LoRA actor trains its adapter alone
        out["weights"] = d * ((params + lora) / (ranks if zero_stage >= 3 else 1) + gathered) / GB
        bucket = min(ZERO3_GRADIENT_BUCKET_MAX, int(params * ZERO3_WINDOW_SHARE), trained) if zero_stage >= 3 \
            else 0
        if ranks > 1:
            bucket *= 2  # the reduce-scatter packs the bucket once more
        out["gradients"] = d * (trained / (ranks if zero_stage >= 2 else 1) + bucket) / GB
        optimizer = 12 * trained / (ranks if zero_stage >= 1 else 1) / GB
        out["cpu_optimizer" if adam_offload else "optimizer"] = optimizer
        if adam_offload:  # with the fp32 gradient partition DeepSpeed's CPU optimizer steps on
            out["host"] = optimizer + 4 * trained / (ranks if zero_stage >= 1 else 1) / GB
        if gradient_checkpointing:
            activations = d * tokens * shape.hidden * shape.layers + layer_working_set
        else:
            activations = layer_working_set * shape.layers
        if role_kind == "actor":
            activations += 8 * tokens * shape.vocab  # fp32 logits and their gradient
            # the leader's two weight-sync buffers, filled at most with what a sync moves (model or adapter)
            activations += min(2 * weight_sync_bucket_mb * 2**20, d * trained)
        out["activations"] = (activations + all_to_all) / GB
    elif role_kind in ("ref", "teacher", "reward"):  # frozen: per-token log-probs (ref, teacher) or scores
        out["weights"] = d * (params / (ranks if zero_stage >= 3 else 1) + gathered) / GB
        activations = layer_working_set + (4 * tokens * shape.vocab if role_kind != "reward" else 0)
        out["activations"] = (activations + all_to_all) / GB
    else:  # rollout
        slot = shape.lora_params(vllm_lora_rank(lora_rank), PROJECTIONS) if lora_rank > 0 else 0
        out["weights"] = d * (params + slot) / tp / GB
        if sleeps_on_host:
            out["host"] = out["weights"]
        out["kv_cache"] = tokens_in_flight * shape.kv_bytes_per_token(tp) / GB
        out["activations"] = (ACTIVATION_BYTES_PER_LAYER_TOKEN_HIDDEN * ROLLOUT_PREFILL_TOKENS * shape.hidden
                              / tp / GB)
    out["total"] = sum(out[k] for k in ("weights", "gradients", "optimizer", "activations", "kv_cache",
                                        "overhead"))
    return out
