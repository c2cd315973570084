"""The RL step's messages: the calls that move a step's responses, scores and figures along the route table
(routes.py: which message goes from whom to whom, and why it is shaped so that no rank's communicators grow with
the number of rollout engines).

How a message travels is hpc_rlhf.dist.exchange's (`post`): nowhere when its sender is its only consumer, point to
point to a single consumer (and on gloo to each consumer when it is small), by a broadcast over the route's group
otherwise. The groups are created once by hpc_rlhf.dist.groups from the rank sets the route table names
(`message_groups`); ranks outside a route take no part and get None.

A batch's responses travel in two hops: each engine's first rank sends its share to the hub (the `engines`
gather), which sends the whole batch to the consumers (`responses` or `eval`). On gloo, when every engine's share
is small, each engine sends its share to each consumer directly instead (one hop, no relay: where ranks share
cores a hop's latency costs more than its bytes, and gloo sets up nothing per pair of ranks).

On a machine where roles share cores, a message costs a rank far more in latency (its partner must be scheduled)
than in bytes, so the messages of one phase travel together, all in flight before any is waited for:
`share_responses` moves a batch's responses and sampling log-probs from every engine in one round (padded to a
size every rank knows), `share_known` a step's scores from every role in one (their lengths follow from the
responses, and what one sender sends to the same ranks goes as one message).
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.dist import exchange, groups
from hpc_rlhf.rl.batches import EPISODE_FIELDS, Generated, SampleBatch, from_ragged, make_batch, shard_bounds
from hpc_rlhf.rl.routes import ENGINES, LOGGING_RANK, Gather, Route, Routes, travels_over_a_group

CRITIC_FIGURES = ("value_loss", "value_clip_fraction", "critic_grad_norm", "critic_skipped")

def _group(path: Route | Gather) -> dist.ProcessGroup | None:
    return groups.message_group(path.key) if travels_over_a_group(path) else None


def _post(flat: torch.Tensor, path: Route, tag: int) -> list:
    """Start moving `flat` along `path` (this rank is on it): the works to wait for."""
    return exchange.post(flat, path.src, path.consumers, group=_group(path), tag=tag)


def _gather(flat: torch.Tensor, path: Gather) -> list[torch.Tensor] | None:
    """`flat` from every rank of `path` (this rank is on it) to its `dst`: there, one per rank in rank order."""
    me = dist.get_rank()
    if len(path.ranks) == 1:
        return [flat]
    if travels_over_a_group(path):
        return exchange.gather_known(flat, path.dst, _group(path))
    other = path.senders[0]  # two ranks: point to point
    if me == path.dst:
        received = torch.empty_like(flat)
        exchange.wait(exchange.post(received, other, [me]))
        return [flat, received] if me < other else [received, flat]
    exchange.wait(exchange.post(flat, me, [path.dst]))
    return None


# ------------------------------------------------------------------------------------------------ known lengths
def share_known(routes: Routes, messages: Mapping[str, tuple[Sequence[torch.Tensor] | None, Sequence[int] | None]],
                dtype: torch.dtype = torch.float32) -> dict[str, list[torch.Tensor] | None]:
    """Several messages of known lengths at once: `messages[key] = (values, lengths)` for route `key`, `values`
    given on the route's sender, `lengths` (of every value) on every rank of the route; the result maps each key
    to its values on the ranks of its route, None elsewhere. Every rank passes the same keys in the same order.

    Messages whose routes have the same sender and ranks travel as one flat message, and every message is in
    flight before any is waited for (`exchange.post`): a rank that consumes several messages waits for the slowest, not
    for their sum."""
    me = dist.get_rank()
    out: dict[str, list[torch.Tensor] | None] = {key: None for key in messages}
    bundles: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, (values, lengths) in messages.items():
        path = routes[key]
        if me not in path.ranks:
            continue
        if lengths is None:
            raise exchange.ExchangeError(f"share_known('{key}'): rank {me} is on the route but knows no lengths")
        if len(path.ranks) == 1:
            out[key] = list(values)
            continue
        bundles.setdefault((path.src, path.ranks), []).append(key)
    device = exchange.comm_device()
    flats = []  # every bundle's buffer, checked and filled before anything travels
    for (src, ranks), keys in bundles.items():
        if me != src:
            flats.append(torch.empty(sum(sum(messages[key][1]) for key in keys), dtype=dtype, device=device))
            continue
        parts = []
        for key in keys:
            values, lengths = messages[key]
            if values is None or [v.numel() for v in values] != list(lengths):
                got = "none" if values is None else [v.numel() for v in values]
                raise exchange.ExchangeError(f"share_known('{key}'): values of lengths {got}, but the route's ranks "
                                             f"expect {list(lengths)}")
            parts += [v.reshape(-1).to(dtype) for v in values]
        flats.append(torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=dtype, device=device))
    order = {key: i for i, key in enumerate(messages)}  # the same on every rank: the bundles' tags
    works = []
    for ((src, ranks), keys), flat in zip(bundles.items(), flats):
        works += _post(flat, routes[keys[0]], tag=order[keys[0]])
    exchange.wait(works)
    for keys, flat in zip(bundles.values(), flats):
        sizes = [sum(messages[key][1]) for key in keys]
        for key, part in zip(keys, torch.split(flat.cpu(), sizes)):
            out[key] = list(torch.split(part, list(messages[key][1])))
    return out



# ------------------------------------------------------------------------------------------------ responses
def _layout(count: int, max_len: int, with_logprobs: bool, with_episodes: bool) -> dict[str, tuple[int, int]]:
    """Where each part of an engine's message lies, in 4-byte words: (start, length) by name."""
    room = count * max_len
    parts = {"lengths": count, "tokens": room}
    if with_logprobs:
        parts["logprobs"] = room
    if with_episodes:
        parts["masks"] = (room + 3) // 4  # one byte per token slot
        parts["episodes"] = count * len(EPISODE_FIELDS)
    layout, start = {}, 0
    for name, size in parts.items():
        layout[name] = (start, size)
        start += size
    return layout


def _pack(share: Generated | None, key: str, count: int, max_len: int, layout: dict[str, tuple[int, int]]
          ) -> torch.Tensor:
    """One engine's share as the words of its message (see `share_responses`), checked against what its consumers
    expect."""
    words = torch.zeros(sum(size for _, size in layout.values()), dtype=torch.int32)
    lengths = None if share is None else [len(t) for t in share.responses]
    if lengths is None or len(lengths) != count or (lengths and max(lengths) > max_len):
        raise exchange.ExchangeError(f"share_responses('{key}'): the engine has {len(lengths or [])} responses of "
                                     f"up to {max(lengths or [0])} tokens; the ranks of the route expect {count} "
                                     f"of at most {max_len}")
    for name in ("logprobs", "masks"):
        values = getattr(share, name)
        if name in layout and (values is None or [len(t) for t in values] != lengths):
            raise exchange.ExchangeError(f"share_responses('{key}'): {name} missing or not as long as the responses")
    if "episodes" in layout and (share.episodes is None or tuple(share.episodes.shape) != (count, len(EPISODE_FIELDS))):
        raise exchange.ExchangeError(f"share_responses('{key}'): no episode figures for its {count} episodes")
    flat, _ = exchange.pack_ragged(share.responses, torch.long)
    if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < 2**31):
        raise exchange.ExchangeError(f"share_responses('{key}'): token ids outside int32")
    total = flat.numel()
    words[:count] = torch.tensor(lengths, dtype=torch.int32)
    start = layout["tokens"][0]
    words[start:start + total] = flat.to(torch.int32)
    if "logprobs" in layout:
        start = layout["logprobs"][0]
        words[start:start + total] = exchange.pack_ragged(share.logprobs, torch.float32)[0].view(torch.int32)
    if "masks" in layout:
        start, size = layout["masks"]
        masks = torch.zeros(size * 4, dtype=torch.uint8)
        masks[:total] = exchange.pack_ragged([m.bool() for m in share.masks], torch.bool)[0].to(torch.uint8)
        words[start:start + size] = masks.view(torch.int32)
        start, size = layout["episodes"]
        words[start:start + size] = share.episodes.float().reshape(-1).view(torch.int32)
    return words


def _unpack(words: torch.Tensor, count: int, layout: dict[str, tuple[int, int]]) -> Generated:
    if count == 0:  # an engine with no share of this batch: at scale most engines in an evaluation's small batch
        episodes = "masks" in layout
        return Generated([], [] if "logprobs" in layout else None, [] if episodes else None,
                         torch.zeros(0, len(EPISODE_FIELDS)) if episodes else None)
    words = words.cpu()
    lengths = words[:count].tolist()
    total = sum(lengths)

    def part(name: str) -> torch.Tensor:
        start, _ = layout[name]
        return words[start:start + total]

    out = Generated(list(torch.split(part("tokens").long(), lengths)))
    if "logprobs" in layout:
        out.logprobs = list(torch.split(part("logprobs").view(torch.float32).clone(), lengths))
    if "masks" in layout:
        start, size = layout["masks"]
        masks = words[start:start + size].view(torch.uint8)[:total].bool()
        out.masks = list(torch.split(masks, lengths))
        start, size = layout["episodes"]
        out.episodes = words[start:start + size].view(torch.float32).clone().reshape(count, len(EPISODE_FIELDS))
    return out


def share_responses(routes: Routes, mine: Generated | None, kind: str, counts: Sequence[int], max_len: int,
                    with_logprobs: bool = False, with_episodes: bool = False) -> list[Generated | None]:
    """Every engine's share of a batch (`mine`, on the engine's first rank; engine E generated `counts[E]` responses
    of at most `max_len` tokens) to the consumers of route `kind` ("responses" or "eval"): per engine, what it
    generated on those consumers, None elsewhere. `with_logprobs`: their sampling log-probs too; `with_episodes`:
    the episodes' masks and figures too (multi-turn samples). Every rank calls it.

    One message per engine, of a size every rank knows: 4-byte words, the lengths, then room for `max_len` token
    ids (int32: vocabularies are far below 2^31) per response, then as much for the log-probs' bits, then
    (episodes) a byte per token slot for the mask and each episode's EPISODE_FIELDS (`_layout`). Padding to the
    longest possible batch costs bytes, which are cheap next to the round trip that announcing the size would cost;
    the log-probs ride in the room int64 ids would have taken, so the ranks that do not need them (ref, reward) get
    no more bytes than the ids alone would have cost them. The engines' messages reach the hub (the `engines`
    gather, padded to the largest), which sends them on as one; or, small on gloo, go from each engine to each
    consumer directly (see the module docstring)."""
    device, me = exchange.comm_device(), dist.get_rank()
    layouts = [_layout(count, max_len, with_logprobs, with_episodes) for count in counts]
    sizes = [sum(size for _, size in layout.values()) for layout in layouts]
    path, engines = routes[kind], routes[ENGINES]
    leaders = engines.ranks
    if len(leaders) != len(counts):
        raise exchange.ExchangeError(f"share_responses('{kind}'): {len(counts)} counts for {len(leaders)} engines")
    words: dict[int, torch.Tensor] = {}
    if me in leaders:
        e = leaders.index(me)
        words[e] = _pack(mine, f"{kind}/{e}", counts[e], max_len, layouts[e]).to(device)
    direct = len(leaders) > 1 and exchange.fans_out_directly(4 * max(sizes), exchange.backend_of())
    if direct:  # each engine to each consumer (the hub too, when it consumes)
        works = []
        for e, leader in enumerate(leaders):
            if me in path.takers and me != leader:
                words[e] = torch.zeros(sizes[e], dtype=torch.int32, device=device)
            if me in path.takers or me == leader:
                works += exchange.post(words[e], leader, path.takers, tag=e)
        exchange.wait(works)
    else:  # to the hub, then the batch from the hub
        if me in leaders and len(leaders) > 1:
            padded = torch.zeros(max(sizes), dtype=torch.int32, device=device)
            padded[:sizes[e]] = words[e]
            gathered = _gather(padded, engines)
            if gathered is not None:
                words = {e: part[:sizes[e]] for e, part in enumerate(gathered)}
        if me in path.ranks:
            flat = (torch.cat([words[e] for e in range(len(leaders))]) if me == path.src
                    else torch.zeros(sum(sizes), dtype=torch.int32, device=device))
            exchange.wait(_post(flat, path, tag=0))
            words = dict(enumerate(torch.split(flat, sizes)))
    if me not in path.takers:
        return [None] * len(counts)
    return [_unpack(words[e], counts[e], layouts[e]) for e in range(len(counts))]


def share_generated(routes: Routes, mine: Generated | None, to: str, prompts: int, n: int, max_len: int, with_logprobs: bool = False,
                    with_episodes: bool = False) -> Generated | None:
    """Each engine's share of a batch of `prompts` prompts x `n` samples of at most `max_len` tokens (`mine`, on
    the engine's first rank) to the consumers of route `to`: the whole batch, prompt-major, on those ranks (the
    scoring ranks and rank 0 for "responses", rank 0 alone for "eval"), None elsewhere; with the parts
    `share_responses` is asked for. Every rank calls it."""
    counts = engine_counts(prompts, len(routes.plan.role("rollout").engines), n)
    parts = share_responses(routes, mine, to, counts, max_len, with_logprobs, with_episodes)
    return None if any(p is None for p in parts) else Generated.concatenated(parts)


def share_batch(routes: Routes, mine: Generated | None, prompt_ids: Sequence[Sequence[int]], n: int, max_len: int,
                pad_id: int, with_episodes: bool = False):
    """Phase 3: each engine's share of a batch (`mine`, on the engine's first rank; `prompt_ids` per sample,
    prompt-major, `n` samples per prompt) with its sampling log-probs to the ranks that consume it: (padded batch,
    what the engines generated, sampling log-probs (B, T-1)) there, Nones elsewhere (rollout-only ranks)."""
    generated = share_generated(routes, mine, "responses", len(prompt_ids) // n, n, max_len, with_logprobs=True,
                                with_episodes=with_episodes)
    if generated is None:
        return None, None, None
    batch = make_batch(prompt_ids, generated.responses, pad_id, generated.masks)
    return batch, generated, from_ragged(generated.logprobs, batch)


@functools.lru_cache(maxsize=64)
def engine_counts(prompts: int, engines: int, n: int) -> tuple[int, ...]:
    """How many responses each engine generates for `prompts` prompts x `n` samples (contiguous prompt shards)."""
    return tuple(n * (end - start) for start, end in (shard_bounds(prompts, engines, e) for e in range(engines)))


# ------------------------------------------------------------------------------------------------ scores
def per_sample_role(role: str) -> bool:
    """Whether a scoring role's result is one number per sample (reward models, the rule rewards) rather than one
    per response token (actor, critic, ref, teacher)."""
    return role.startswith("reward") or role == "rules"


def share_scores(routes: Routes, local: dict[str, list[torch.Tensor] | None], roles: list[str], rules: list[torch.Tensor] | None,
                 with_rules: bool, batch: SampleBatch | None) -> dict[str, torch.Tensor]:
    """Every scoring role's results (`local[role]`, on its leader) and the rule rewards (`rules`, on their rank)
    to the trained roles, all in one round (`share_known`; the lengths follow from the responses): dense on those
    ranks, (B, T-1) per-token tensors for actor, critic and ref, (B,) scores of each reward model and "rules"
    (zeros without rule or remote rewards)."""
    response_lens = None if batch is None else batch.response_lens
    scored = {}
    for key, full in share_known(routes, score_messages(local, roles, rules, with_rules, response_lens)).items():
        role = key.removeprefix("scores/")
        if full is not None:
            scored[role] = torch.cat(full) if per_sample_role(role) else from_ragged(full, batch)
    if not with_rules and batch is not None:
        scored["rules"] = torch.zeros(len(batch.response_lens))
    return scored


def score_messages(local: dict[str, list[torch.Tensor] | None], roles: list[str], rules: list[torch.Tensor] | None,
                   with_rules: bool, response_lens: list[int] | None) -> dict[str, tuple]:
    """What `share_scores` hands `share_known`: per route `scores/ROLE`, (values on the sender, lengths on the
    ranks that know the responses' lengths)."""
    def lengths_of(role):
        if response_lens is None:
            return None
        return [1] * len(response_lens) if per_sample_role(role) else response_lens

    messages = {f"scores/{role}": (local.get(role), lengths_of(role)) for role in roles}
    if with_rules:
        messages["scores/rules"] = (rules, None if response_lens is None else [len(response_lens)])
    return messages


# ------------------------------------------------------------------------------------------------ figures
def critic_figures_to_logger(routes: Routes, figures: dict[str, float]) -> dict[str, float]:
    """The critic's training figures (CRITIC_FIGURES, on its leader) to the logging rank: there, those it logs;
    {} elsewhere. Every rank calls it.

    Route `figures/critic`: a gather over the trained ranks, the others sending NaNs that rank 0 drops (a group
    rank 0 belongs to anyway, rather than a point-to-point pair of its own on NCCL); on gloo, or with two trained
    ranks, the critic's leader sends them to rank 0 directly."""
    if not routes.plan.has("critic"):
        return {}
    path = routes["figures/critic"]
    me, critic = dist.get_rank(), routes.plan.role("critic").leader
    if me not in path.ranks:
        return {}
    values = torch.tensor([figures.get(k, float("nan")) if me == critic else float("nan") for k in CRITIC_FIGURES],
                          dtype=torch.float64)
    nbytes = values.numel() * values.element_size()
    if critic == LOGGING_RANK:
        pass
    elif exchange.fans_out_directly(nbytes, exchange.backend_of()) or len(path.ranks) == 2:
        if me == critic:
            exchange.send_known(values, LOGGING_RANK, len(CRITIC_FIGURES), torch.float64)
        elif me == LOGGING_RANK:
            values = exchange.recv_known(critic, len(CRITIC_FIGURES), torch.float64)
    else:
        gathered = _gather(values.to(exchange.comm_device()), path)
        if gathered is not None:
            values = gathered[path.ranks.index(critic)].cpu()
    if me != LOGGING_RANK:
        return {}
    logged = dict(zip(CRITIC_FIGURES, values.tolist()))
    del logged["critic_skipped"]  # counted with the actor's skips in `skipped_steps`
    return logged
