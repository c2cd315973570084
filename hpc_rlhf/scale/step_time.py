"""How long one RL step takes, by phase, and its critical path: a model from the model's shapes, the placement, the
batch settings and a hardware profile (hardware.py). Pure Python (`hpc-rlhf plan --step-time` runs on login nodes).
Its inputs and their sources: docs/planner.md; its validation: benchmarks/step_time.md.

Phases, each on the ranks that run it (B = prompts x samples sequences of prompt_len + response_len tokens;
N = a model's parameters; R = a role's ranks):
- generation: every engine (rollout_tp ranks) generates its contiguous share of the prompts, `rollout_seqs`
  sequences at a time. A wave is a prefill (FLOP-bound, as scoring) and as many decode steps as its longest
  response (`max_response_len`); every step reads the engine's weights, every generated token (`response_len`
  on average) reads its sequence's KV cache (memory-bound: bytes / (HBM bandwidth x memory_efficiency)), unless
  the matrix products take longer (2 N per token at mfu_decode); plus a fixed decode_step_overhead_s per step
  and, with rollout_tp > 1, two all-reduces per layer (latency). The phase is the slowest engine.
- exchange: the engines' responses (4-byte words: lengths, token ids, sampling log-probs) to the hub and on to
  the scoring ranks (rl/routes.py), then after scoring each role's results to the trained ranks, each at the
  link's bandwidth plus a latency per message and hop (on gloo, small messages go point to point to each
  consumer: the sender's bytes times its consumers).
- scoring: actor (old log-probs), critic, ref and reward models, each a forward pass over B sequences on its R
  ranks: (2 N + attention) FLOPs per token at mfu_score, plus pass_overhead_s per micro-batch and, under ZeRO-3,
  the gathering of the whole model in every pass (2 N bytes (R-1)/R over the role's slowest link, overlapped with
  the compute: whichever is longer); the results gathered to the role's leader. Roles on other ranks run at the
  same time (the phase is the slowest); roles sharing ranks add up.
- training: actor and critic, ppo_epochs passes over B sequences: forward and backward (6 N FLOPs per token, 8 N
  with gradient checkpointing) at mfu_train, micro-batch overheads, an optimizer step overhead per step, and
  ZeRO's traffic (ZeRO-3: gathering the model forward and backward and reduce-scattering the gradients in every
  pass; ZeRO 1-2: a reduce-scatter and an all-gather per optimizer step; ZeRO-0: an all-reduce), overlapped.
- sequence parallel (`<kind>_sp` = K > 1, hpc_rlhf/models/sequence_parallel.py): a role's samples are cut among
  its R / K blocks, not its R ranks, and each rank of a block computes 1/K of its block's work, so the FLOPs per
  rank are those of one replica's share over K (the role's total unchanged) while micro-batch passes (and ZeRO-3's
  gathers) count per block. Added, not overlapped (attention waits for its heads): `sequence_exchange`, per layer
  four all-to-alls (q, k, v before attention, its output after) of the rank's chunk of the rows, heads x head
  size wide (key/value heads repeated to the query heads when K does not divide them), each sending (K-1)/K of
  its tensor at the bandwidth of the link the block sits on (its node's; across nodes when a block is larger than
  a node); training repeats them in the backward, and under gradient checkpointing once more in the forward
  recomputed; plus, once per pass, the all-gather of the 4-byte per-token outputs (log-probs, values). A
  latency per all-to-all and per gather.
- weight_sync (disjoint placements): the actor's leader streams the bf16 weights to every rollout rank in the
  order and buckets of hpc_rlhf.dist.bucket_plan (the project's schedule): a tensor of at least a bucket (or 4 MB)
  goes alone and is waited for; the others are packed and a full bucket travels while the next modules are
  gathered (two buffers). Gathering a module under ZeRO-3 crosses the actor's ranks. A broadcast over the
  weight-sync group runs at the slowest link it crosses (NCCL pipelines it along a ring; gloo's tree takes
  log2 hops). The hybrid vLLM engine loads the weights locally instead (HBM copy); the hybrid hf engine uses the
  actor's own module (nothing moves).

Critical path: synchronous (rl.max_staleness K = 0) the phases follow one another: generation, exchange, scoring,
exchange back, training, weight sync. With K >= 1 the engines generate the next batch while the others score and
train this one: exchange + max(generation, scoring + exchange back + training) + weight sync.

On a `cpu` profile the ranks share `cores` cores, one thread each: a phase whose busy ranks outnumber the cores is
slowed by busy / cores.

Lengths: `response_len` is the mean response (tokens scored and trained on; the project's own recipe pads a
micro-batch to its longest sequence, so give it the padded length for its runs), `max_response_len` the longest
(decode steps of a wave, and the room every message keeps per response). What the model leaves out: stragglers
and load imbalance between engines beyond their shares, vLLM's continuous batching refilling finished sequences
(a wave lasts as long as its longest response), activation recomputation beyond gradient checkpointing, the
CPU Adam of --adam-offload, MoE routing (active parameters are used for FLOPs, all parameters for weight bytes),
and contention between messages sharing a link.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hpc_rlhf.dist import bucket_plan
from hpc_rlhf.dist.memory import ModelShape
from hpc_rlhf.dist.placement import Plan
from hpc_rlhf.rl import routes
from hpc_rlhf.scale.hardware import Profile

PHASES = ("generation", "exchange", "scoring", "training", "weight_sync")


@dataclass(frozen=True)
class StepSettings:
    prompts: int = 128
    samples: int = 8
    prompt_len: int = 512
    response_len: int = 1024  # mean new tokens per response (what is scored and trained on)
    max_response_len: int | None = None  # the longest response (None: response_len): decode steps, message room
    ppo_epochs: int = 1
    train_batch: int | None = None  # samples per optimizer step (None: the whole step's batch)
    micro_batch_size: int = 4  # sequences per rank in one training or scoring pass
    micro_batch_tokens: int = 0  # > 0: passes of this many tokens instead (rl.micro_batch_tokens; a longer one alone)
    zero_stage: int = 3
    gradient_checkpointing: bool = True
    bucket_mb: float = 256.0
    max_staleness: int = 0
    rollout_seqs: int = 256  # sequences an engine generates at once
    rollout_backend: str = "vllm"  # "hf" for the hybrid placement: generation on the actor's own module

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def longest(self) -> int:
        return self.max_response_len or self.response_len


class StepTimeError(ValueError):
    """Settings the model cannot predict from."""


# ------------------------------------------------------------------------------------------------ building blocks
def attention_flops_per_token(shape: ModelShape, context: float) -> float:
    """Attention's score and value products for one token attending to `context` tokens (forward)."""
    return 4 * shape.layers * shape.heads * shape.head_size * context


def forward_flops(shape: ModelShape, sequences: int, seq_len: int, lm_head: bool = True) -> float:
    """A forward pass over `sequences` causal sequences of `seq_len` tokens."""
    params = shape.active_params if lm_head else shape.active_params - shape.vocab * shape.hidden
    return sequences * seq_len * (2 * params + attention_flops_per_token(shape, seq_len / 2))


def _link(plan: Plan, ranks, profile: Profile) -> float:
    """The slowest link between `ranks`: within a node, or across nodes."""
    nodes = {r // plan.ranks_per_node for r in ranks}
    return profile.intra_node_bytes_per_s if len(nodes) <= 1 else profile.inter_node_bytes_per_s


def _busy(profile: Profile, ranks: int) -> float:
    """How much slower `ranks` busy ranks run when they share the profile's cores (1 on GPUs)."""
    return max(1.0, ranks / profile.cores) if profile.cores else 1.0


def _broadcast_s(nbytes: float, receivers: int, link: float, profile: Profile) -> float:
    if receivers <= 0 or nbytes <= 0:
        return 0.0
    if profile.cores:  # gloo: a binomial tree, log2 hops of the whole message
        hops = math.ceil(math.log2(receivers + 1))
        return hops * (profile.latency_s + nbytes / link)
    return nbytes / link + profile.latency_s * math.ceil(math.log2(receivers + 1))  # NCCL: pipelined


# ------------------------------------------------------------------------------------------------ sequence parallel
OUTPUT_BYTES_PER_TOKEN = 4  # the per-token outputs a block gathers: fp32 log-probs (actor, ref) or values


def _shares(plan: Plan, name: str, samples: int, s: StepSettings) -> tuple[int, int, int]:
    """(K, samples per block, micro-batch passes per block) of role `name`: its samples are cut among its blocks
    of K ranks (one rank each at K = 1), a block taking `micro_batch_size` samples per pass (rl/training.py), or
    with `micro_batch_tokens` as many as fit that budget: the block's tokens over it at the mean length, at most one
    pass per sample (rl/micro_batches.py)."""
    k = plan.sequence_parallel(name)
    per_block = math.ceil(samples / (plan.role(name).size // k))
    if s.micro_batch_tokens:
        return k, per_block, min(per_block, math.ceil(per_block * s.seq_len / s.micro_batch_tokens))
    return k, per_block, math.ceil(per_block / s.micro_batch_size)


def sequence_exchange_bytes(shape: ModelShape, tokens: float, k: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank of a sequence block of K sends in the all-to-alls of one forward over `tokens` tokens of
    rows (the block's; the rank holds tokens / K): per layer q, k and v before attention and the output after
    it, each (local tokens x heads x head size), of which (K-1)/K leaves the rank. Key/value heads travel
    repeated to one per query head when K does not divide them (hpc_rlhf/models/sequence_parallel.py). 0 at
    K = 1."""
    if k == 1:
        return 0.0
    kv = shape.kv_heads if shape.kv_heads % k == 0 else shape.heads
    per_token_layer = (2 * shape.heads + 2 * kv) * shape.head_size * dtype_bytes
    return shape.layers * tokens / k * per_token_layer * (k - 1) / k


def _block_link(plan: Plan, name: str, profile: Profile) -> float:
    """The slowest link inside any of the role's sequence blocks (the node's, unless a block spans nodes)."""
    return min(_link(plan, block, profile) for block in plan.sequence_blocks(name))


def sequence_exchange_s(plan: Plan, name: str, shape: ModelShape, samples: int, seq_len: int, passes: int,
                        forwards: int, profile: Profile) -> float:
    """The exchanges of role `name`'s sequence blocks over `samples` samples of `seq_len` tokens per block in
    `passes` passes: the layers' all-to-alls `forwards` times (scoring 1; training 2, the backward running them
    in reverse, and 3 under gradient checkpointing, whose recomputed forward runs them again), and once per pass
    the all-gather of the per-token outputs (its backward keeps the rank's chunk: nothing moves). 0 at K = 1."""
    k = plan.sequence_parallel(name)
    if k == 1:
        return 0.0
    link = _block_link(plan, name, profile)
    tokens = samples * seq_len
    all_to_all = forwards * (sequence_exchange_bytes(shape, tokens, k, profile.bytes_per_param) / link
                             + 4 * shape.layers * passes * profile.latency_s)
    gather = OUTPUT_BYTES_PER_TOKEN * tokens * (k - 1) / k / link + passes * profile.latency_s
    return all_to_all + gather


def sequence_exchange_by_role(plan: Plan, shapes: dict[str, ModelShape], s: StepSettings,
                              profile: Profile) -> dict[str, dict[str, float]]:
    """`{role: {"scoring": seconds, "training": seconds}}` of the sequence-parallel roles (K > 1): the part of
    scoring_s and training_s their exchanges take."""
    out = {}
    for name, role in plan.roles.items():
        if role.kind == "rollout" or plan.sequence_parallel(name) == 1:
            continue
        shape = shapes[role.kind]
        _, per_block, passes = _shares(plan, name, s.sequences, s)
        out[name] = {"scoring": sequence_exchange_s(plan, name, shape, per_block, s.seq_len, passes, 1, profile)}
        if name in ("actor", "critic"):
            _, per_block, passes = _shares(plan, name, s.sequences * s.ppo_epochs, s)
            out[name]["training"] = sequence_exchange_s(plan, name, shape, per_block, s.seq_len, passes,
                                                        _training_forwards(s), profile)
    return out


def _training_forwards(s: StepSettings) -> int:
    """How many times a training pass runs the layers' all-to-alls (sequence_exchange_s)."""
    return 3 if s.gradient_checkpointing else 2


# ------------------------------------------------------------------------------------------------ phases
def generation_s(plan: Plan, shape: ModelShape, s: StepSettings, profile: Profile) -> float:
    engines = plan.role("rollout").engines
    tp = len(engines[0])
    share = math.ceil(s.prompts / len(engines)) * s.samples
    weight_bytes = shape.num_params * profile.bytes_per_param / tp
    kv_per_token = shape.kv_bytes_per_token(tp, profile.bytes_per_param)
    bandwidth = profile.memory_bytes_per_s * profile.memory_efficiency
    total, left = 0.0, share
    while left > 0:
        wave = min(left, s.rollout_seqs)
        left -= wave
        prefill = forward_flops(shape, wave, s.prompt_len) / tp / (profile.peak_flops * profile.mfu_score)
        # A wave lasts as many decode steps as its longest response; each step reads the weights, each token
        # of each response reads the KV cache of its context once (on average the prompt and half the response)
        steps = s.longest
        context = s.prompt_len + s.response_len / 2
        read = (steps * weight_bytes + wave * s.response_len * context * kv_per_token) / bandwidth
        compute = wave * s.response_len * (2 * shape.active_params + attention_flops_per_token(shape, context)) / tp \
            / (profile.peak_flops * profile.mfu_decode)
        tp_sync = 2 * shape.layers * profile.latency_s if tp > 1 else 0.0
        total += prefill + profile.pass_overhead_s + steps * (profile.decode_step_overhead_s + tp_sync) \
            + max(read, compute)
    return total


def response_bytes(plan: Plan, s: StepSettings) -> list[int]:
    """Each engine's message of a batch (messages.share_responses: lengths, ids, log-probs, 4-byte words)."""
    engines = len(plan.role("rollout").engines)
    shares = [s.samples * (s.prompts // engines + (1 if e < s.prompts % engines else 0)) for e in range(engines)]
    return [4 * (n + 2 * n * s.longest) for n in shares]


def exchange_s(plan: Plan, s: StepSettings, profile: Profile) -> tuple[float, float]:
    """(responses to the scoring ranks, scores back to the trained ranks)."""
    table = routes.routes_of(plan)
    sizes = response_bytes(plan, s)
    batch = table["responses"]
    consumers = len(batch.consumers)
    engines = table[routes.ENGINES]
    link = _link(plan, batch.ranks + engines.ranks, profile)
    if profile.cores:  # gloo, small messages: each engine to each consumer directly, all in flight
        responses = len(sizes) * consumers * profile.latency_s + sum(sizes) * consumers / link
    else:
        gather = (len(engines.ranks) - 1) * max(sizes) / link + profile.latency_s if len(engines.ranks) > 1 else 0
        responses = gather + _broadcast_s(sum(sizes), consumers, link, profile)
    back = 0.0
    per_token = 4 * s.sequences * s.longest
    for key, route in table.items():
        if not key.startswith("scores/") or key == "scores/rules" or not isinstance(route, routes.Route):
            continue
        kind = plan.role(key.removeprefix("scores/")).kind
        nbytes = 4 * s.sequences if kind == "reward" else per_token
        back = max(back, _broadcast_s(nbytes, len(route.consumers), _link(plan, route.ranks, profile), profile))
    return responses, back


def _zero3_pass_s(plan: Plan, ranks, params: int, profile: Profile, times: int) -> float:
    """ZeRO-3's traffic in one pass: the whole model gathered `times` times (forward 1; forward, backward and the
    gradients' reduce-scatter 3)."""
    if len(ranks) < 2:
        return 0.0
    return times * profile.bytes_per_param * params * (len(ranks) - 1) / len(ranks) / _link(plan, ranks, profile)


def scoring_s(plan: Plan, shapes: dict[str, ModelShape], s: StepSettings, profile: Profile) -> dict[str, float]:
    """Per role, its scoring on its ranks (the leader's gather of the results included)."""
    out = {}
    for name, role in plan.roles.items():
        if role.kind == "rollout":
            continue
        shape = shapes[role.kind]
        lm_head = role.kind in ("actor", "ref", "teacher")
        k, per_block, passes = _shares(plan, name, s.sequences, s)
        compute = forward_flops(shape, per_block, s.seq_len, lm_head) / k / (profile.peak_flops * profile.mfu_score)
        zero = passes * _zero3_pass_s(plan, role.ranks, shape.params(lm_head), profile, 1) if s.zero_stage == 3 else 0
        exchange = sequence_exchange_s(plan, name, shape, per_block, s.seq_len, passes, 1, profile)
        gather = (4 * s.sequences * (s.longest if role.kind != "reward" else 1) / _link(plan, role.ranks, profile)
                  + profile.latency_s if role.size > 1 else 0.0)
        out[name] = max(compute, zero) + exchange + passes * profile.pass_overhead_s + gather
    return out


def training_s(plan: Plan, shapes: dict[str, ModelShape], s: StepSettings, profile: Profile) -> dict[str, float]:
    out = {}
    for name in ("actor", "critic"):
        if not plan.has(name):
            continue
        role, shape = plan.role(name), shapes[name]
        lm_head = name == "actor"
        params = shape.params(lm_head)
        k, per_block, passes = _shares(plan, name, s.sequences * s.ppo_epochs, s)
        steps = s.ppo_epochs * math.ceil(s.sequences / (s.train_batch or s.sequences))
        factor = 4 if s.gradient_checkpointing else 3  # forward (again) + backward = 2 forwards
        compute = factor * forward_flops(shape, per_block, s.seq_len, lm_head) / k \
            / (profile.peak_flops * profile.mfu_train)
        exchange = sequence_exchange_s(plan, name, shape, per_block, s.seq_len, passes, _training_forwards(s),
                                       profile)
        traffic = profile.bytes_per_param * params * (role.size - 1) / role.size / _link(plan, role.ranks, profile) \
            if role.size > 1 else 0.0
        if s.zero_stage == 3:
            comm = passes * _zero3_pass_s(plan, role.ranks, params, profile, 3)
        else:
            comm = steps * 2 * traffic  # reduce-scatter + all-gather (ZeRO 1-2), or an all-reduce (ZeRO-0)
        overheads = 2 * passes * profile.pass_overhead_s + steps * profile.optimizer_step_overhead_s
        out[name] = max(compute, comm) + exchange + overheads
    return out


def weight_sync_s(plan: Plan, shape: ModelShape, s: StepSettings, profile: Profile) -> float:
    """One sync along the project's bucket schedule (module docstring)."""
    if plan.is_hybrid:
        if s.rollout_backend == "hf":
            return 0.0
        return shape.num_params * profile.bytes_per_param / profile.memory_bytes_per_s  # local copy into vLLM
    actor, rollout = plan.role("actor"), plan.role("rollout")
    group = sorted({actor.leader} | set(rollout.ranks))
    link = _link(plan, group, profile)
    size = profile.bytes_per_param
    dtype = f"{size}-byte"
    tensors = [(name, numel, dtype, size) for name, numel in shape.streamed_tensors()]
    gather_link = _link(plan, actor.ranks, profile)
    share = (actor.size - 1) / actor.size if s.zero_stage == 3 else 0.0

    def gathered(nbytes: int) -> float:  # ZeRO-3: a module's parameters from every actor rank
        return nbytes * share / gather_link

    receivers = len(group) - 1
    now, in_flight = 0.0, []  # the sends of the two bucket buffers, by end time
    numel_of = {name: numel * size for name, numel, _, _ in tensors}
    for message in bucket_plan.messages(tensors, int(s.bucket_mb * 2**20)):
        now += sum(gathered(numel_of[name]) for name in message.tensors)
        send = _broadcast_s(message.nbytes, receivers, link, profile)
        if message.straight_through:  # sent from its own storage and waited for
            now = max(now, in_flight[-1] if in_flight else 0.0) + send
            continue
        if len(in_flight) == 2:  # both buffers in flight: wait for the older one
            now = max(now, in_flight.pop(0))
        start = max(now, in_flight[-1] if in_flight else 0.0)
        in_flight.append(start + send)
    return max([now] + in_flight) + profile.latency_s


# ------------------------------------------------------------------------------------------------ the step
def predict(plan: Plan, shapes: dict[str, ModelShape], s: StepSettings, profile: Profile) -> dict:
    """`{"phases": {name: seconds}, "total_s": X, "critical_path": [...], "detail": {...}}` for one RL step."""
    if not plan.has("rollout"):
        raise StepTimeError("the placement has no rollout role: the step-time model is for RL steps")
    if s.max_staleness and plan.is_hybrid:
        raise StepTimeError("rl.max_staleness >= 1 needs disjoint rollout engines, not rollout@actor")
    shapes = {"actor": shapes["actor"], "critic": shapes.get("critic", shapes["actor"]),
              "ref": shapes.get("ref", shapes["actor"]), "teacher": shapes.get("teacher", shapes["actor"]),
              "reward": shapes.get("reward", shapes["actor"])}
    engines = plan.role("rollout").engines
    scorer_ranks = {r for role in plan.roles.values() if role.kind != "rollout" for r in role.ranks}
    trainer_ranks = {r for n in ("actor", "critic") if plan.has(n) for r in plan.role(n).ranks}
    overlap = s.max_staleness > 0
    busy_generating = len(engines) + (len(scorer_ranks) if overlap else 0)

    generation = generation_s(plan, shapes["actor"], s, profile) * _busy(profile, busy_generating)
    responses, back = exchange_s(plan, s, profile)
    per_role = scoring_s(plan, shapes, s, profile)
    per_role_train = training_s(plan, shapes, s, profile)

    def by_ranks(times: dict[str, float]) -> tuple[float, list[str]]:
        """The phase's time and the roles that set it: roles on other ranks run at once, on the same ranks one
        by one."""
        groups: dict[tuple, list[str]] = {}
        for name in times:
            groups.setdefault(plan.role(name).ranks, []).append(name)
        slowest = max(groups.values(), key=lambda names: sum(times[n] for n in names), default=[])
        return max((sum(times[n] for n in names) for names in groups.values()), default=0.0), slowest

    busy_scoring = _busy(profile, len(scorer_ranks) + (len(engines) if overlap else 0))
    busy_training = _busy(profile, len(trainer_ranks) + (len(engines) if overlap else 0))
    scoring, scoring_roles = by_ranks(per_role)
    training, training_roles = by_ranks(per_role_train)
    scoring, training = scoring * busy_scoring, training * busy_training
    # What sequence parallelism's exchanges take of the scoring and training phases: those of the roles that set
    # each phase (the phases include them; they are shown apart so that a reader sees what the blocks cost).
    exchanges = sequence_exchange_by_role(plan, shapes, s, profile)
    sequence_exchange = {
        "scoring": busy_scoring * sum(exchanges.get(n, {}).get("scoring", 0.0) for n in scoring_roles),
        "training": busy_training * sum(exchanges.get(n, {}).get("training", 0.0) for n in training_roles)}
    sync = weight_sync_s(plan, shapes["actor"], s, profile)
    if overlap:
        path = [("exchange", responses), ("generation || scoring + exchange back + training",
                                          max(generation, scoring + back + training)), ("weight_sync", sync)]
    else:
        path = [("generation", generation), ("exchange", responses), ("scoring", scoring),
                ("exchange back", back), ("training", training), ("weight_sync", sync)]
    phases = {"generation": generation, "exchange": responses + back, "scoring": scoring, "training": training,
              "weight_sync": sync}
    # The phase times the recipe logs on rank 0 (rl/metrics.py step_timing): with K >= 1 rank 0 waits for the
    # engines' generation at the weight sync, which they join when done.
    waiting = max(0.0, generation - scoring - back - training) if overlap else 0.0
    as_logged = {"time_generate": responses + (0.0 if overlap else generation), "time_score": scoring + back,
                 "time_train": training, "time_sync": sync + waiting}
    total = sum(t for _, t in path)
    return {
        "phases": {k: round(v, 6) for k, v in phases.items()},
        "total_s": round(total, 6),
        "critical_path": [[name, round(t, 6)] for name, t in path],
        "detail": {"exchange_responses_s": round(responses, 6), "exchange_scores_s": round(back, 6),
                   "scoring_by_role_s": {k: round(v, 6) for k, v in per_role.items()},
                   "training_by_role_s": {k: round(v, 6) for k, v in per_role_train.items()},
                   "sequence_exchange_s": {k: round(v, 6) for k, v in sequence_exchange.items()},
                   "sequence_exchange_by_role_s": {n: {k: round(v, 6) for k, v in by.items()}
                                                   for n, by in exchanges.items()},
                   "generation_waiting_s": round(waiting, 6),
                   "as_logged": {k: round(v, 6) for k, v in as_logged.items()},
                   "samples_per_s": round(s.sequences / total, 3) if total else None},
        "settings": asdict(s), "hardware": profile.name,
    }
