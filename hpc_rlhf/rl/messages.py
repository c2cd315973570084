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
from hpc_rlhf.dist.placement import Plan
from hpc_rlhf.rl.experience import SampleBatch, from_ragged, shard_bounds
from hpc_rlhf.rl.routes import (ENGINES, LOGGING_RANK, Gather, Route, engine_leaders, message_groups,  # noqa: F401
                                routes_of, rule_reward_rank, travels_over_a_group)

CRITIC_FIGURES = ("value_loss", "value_clip_fraction", "critic_grad_norm", "critic_skipped")

_TABLE: tuple[Plan | None, dict[str, Route | Gather]] = (None, {})


def route(key: str) -> Route | Gather:
    """The route of message `key` in the placement of this job (public knowledge: any rank may ask)."""
    global _TABLE
    plan = groups.plan()
    if _TABLE[0] is not plan:
        _TABLE = (plan, routes_of(plan))
    table = _TABLE[1]
    if key not in table:
        raise KeyError(f"no route '{key}' in this placement; routes: {', '.join(table)}")
    return table[key]


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
def share_known(messages: Mapping[str, tuple[Sequence[torch.Tensor] | None, Sequence[int] | None]],
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
        path = route(key)
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
        works += _post(flat, route(keys[0]), tag=order[keys[0]])
    exchange.wait(works)
    for keys, flat in zip(bundles.values(), flats):
        sizes = [sum(messages[key][1]) for key in keys]
        for key, part in zip(keys, torch.split(flat.cpu(), sizes)):
            out[key] = list(torch.split(part, list(messages[key][1])))
    return out



# ------------------------------------------------------------------------------------------------ responses
def share_responses(mine: Sequence[torch.Tensor] | None, mine_logps: Sequence[torch.Tensor] | None, kind: str,
                    counts: Sequence[int], max_len: int, with_logprobs: bool = False
                    ) -> tuple[list[list[torch.Tensor] | None], list[list[torch.Tensor] | None]]:
    """Every engine's responses (`mine`: token ids, on the engine's first rank; engine E generated `counts[E]`
    responses of at most `max_len` tokens) to the consumers of route `kind` ("responses" or "eval"), with
    `with_logprobs` their sampling log-probs (`mine_logps`) too: per engine, (token ids, log-probs) on those
    consumers, None elsewhere. Every rank calls it.

    One message per engine, of a size every rank knows: 4-byte words, the lengths, then room for `max_len` token
    ids (int32: vocabularies are far below 2^31) per response, then as much for the log-probs' bits. Padding to
    the longest possible batch costs bytes, which are cheap next to the round trip that announcing the size would
    cost; the log-probs ride in the room int64 ids would have taken, so the ranks that do not need them (ref,
    reward) get no more bytes than the ids alone would have cost them. The engines' messages reach the hub (the
    `engines` gather, padded to the largest), which sends them on as one; or, small on gloo, go from each engine
    to each consumer directly (see the module docstring)."""
    device, me = exchange.comm_device(), dist.get_rank()
    width = 2 if with_logprobs else 1
    sizes = [count + width * count * max_len for count in counts]
    path, engines = route(kind), route(ENGINES)
    leaders = engines.ranks
    if len(leaders) != len(counts):
        raise exchange.ExchangeError(f"share_responses('{kind}'): {len(counts)} counts for {len(leaders)} engines")
    words: dict[int, torch.Tensor] = {}
    if me in leaders:
        e = leaders.index(me)
        words[e] = _response_words(mine, mine_logps, f"{kind}/{e}", counts[e], max_len, with_logprobs).to(device)
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
    tokens: list[list[torch.Tensor] | None] = [None] * len(counts)
    logps: list[list[torch.Tensor] | None] = [None] * len(counts)
    if me not in path.takers:
        return tokens, logps
    # Every engine's part at once: one split for the whole batch (thousands of engines, thousands of responses).
    parts = [(e, words[e].cpu()) for e in sorted(words)]
    lengths = torch.cat([flat[:counts[e]] for e, flat in parts]).tolist()
    totals, start = [], 0
    for e, _ in parts:
        totals.append(sum(lengths[start:start + counts[e]]))
        start += counts[e]
    ids = torch.cat([flat[counts[e]:counts[e] + total] for (e, flat), total in zip(parts, totals)])
    per_sample = torch.split(ids.long(), lengths)
    if with_logprobs:
        bits = torch.cat([flat[counts[e] * (1 + max_len):counts[e] * (1 + max_len) + total]
                          for (e, flat), total in zip(parts, totals)])
        per_sample_logps = torch.split(bits.view(torch.float32).clone(), lengths)
    start = 0
    for e, _ in parts:
        tokens[e] = list(per_sample[start:start + counts[e]])
        if with_logprobs:
            logps[e] = list(per_sample_logps[start:start + counts[e]])
        start += counts[e]
    return tokens, logps


def _response_words(mine: Sequence[torch.Tensor] | None, mine_logps: Sequence[torch.Tensor] | None, what: str,
                    count: int, max_len: int, with_logprobs: bool) -> torch.Tensor:
    """One engine's message (see share_responses), checked against the size its consumers expect."""
    room = count * max_len
    words = torch.zeros(count + (2 if with_logprobs else 1) * room, dtype=torch.int32)
    lengths = [len(t) for t in mine] if mine is not None else None
    if lengths is None or len(lengths) != count or (lengths and max(lengths) > max_len):
        raise exchange.ExchangeError(f"share_responses('{what}'): the engine has {len(lengths or [])} responses of "
                                     f"up to {max(lengths or [0])} tokens; its consumers expect {count} of at most "
                                     f"{max_len}")
    if with_logprobs and (mine_logps is None or [len(t) for t in mine_logps] != lengths):
        raise exchange.ExchangeError(f"share_responses('{what}'): log-probs missing or not as long as the responses")
    flat, _ = exchange.pack_ragged(mine, torch.long)
    if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < 2**31):
        raise exchange.ExchangeError(f"share_responses('{what}'): token ids outside int32")
    total = flat.numel()
    words[:count] = torch.tensor(lengths, dtype=torch.int32)
    words[count:count + total] = flat.to(torch.int32)
    if with_logprobs:
        words[count + room:count + room + total] = exchange.pack_ragged(mine_logps, torch.float32)[0].view(torch.int32)
    return words


def concatenated(per_engine: list[list[torch.Tensor] | None]) -> list[torch.Tensor] | None:
    """The engines' lists in engine order, on the ranks that got every one of them; None elsewhere."""
    if any(part is None for part in per_engine):
        return None
    return [t for part in per_engine for t in part]


def share_generated(mine: list[torch.Tensor] | None, mine_logps: list[torch.Tensor] | None, to: str, prompts: int,
                    n: int, max_len: int, with_logprobs: bool = False
                    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Each engine's share of a batch of `prompts` prompts x `n` samples of at most `max_len` tokens (`mine`, on
    the engine's first rank) to the consumers of route `to`: every response, prompt-major, on those ranks (the
    scoring ranks and rank 0 for "responses", rank 0 alone for "eval"), and with `with_logprobs` their sampling
    log-probs on the same ranks (in the same messages: `share_responses`); None elsewhere. Every rank calls it."""
    counts = engine_counts(prompts, len(groups.plan().role("rollout").engines), n)
    responses, logps = share_responses(mine, mine_logps, to, counts, max_len, with_logprobs)
    return concatenated(responses), concatenated(logps) if with_logprobs else None


@functools.lru_cache(maxsize=64)
def engine_counts(prompts: int, engines: int, n: int) -> tuple[int, ...]:
    """How many responses each engine generates for `prompts` prompts x `n` samples (contiguous prompt shards)."""
    return tuple(n * (end - start) for start, end in (shard_bounds(prompts, engines, e) for e in range(engines)))


# ------------------------------------------------------------------------------------------------ scores
def share_scores(local: dict[str, list[torch.Tensor] | None], roles: list[str], rules: list[torch.Tensor] | None,
                 with_rules: bool, batch: SampleBatch | None) -> dict[str, torch.Tensor]:
    """Every scoring role's results (`local[role]`, on its leader) and the rule rewards (`rules`, on their rank)
    to the trained roles, all in one round (`share_known`; the lengths follow from the responses): dense on those
    ranks, (B, T-1) per-token tensors for actor, critic and ref, (B,) scores of each reward model and "rules"
    (zeros without rule or remote rewards)."""
    response_lens = None if batch is None else batch.response_lens
    scored = {}
    for key, full in share_known(score_messages(local, roles, rules, with_rules, response_lens)).items():
        role = key.removeprefix("scores/")
        if full is not None:
            per_sample = role.startswith("reward") or role == "rules"
            scored[role] = torch.cat(full) if per_sample else from_ragged(full, batch)
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
        return [1] * len(response_lens) if role.startswith("reward") or role == "rules" else response_lens

    messages = {f"scores/{role}": (local.get(role), lengths_of(role)) for role in roles}
    if with_rules:
        messages["scores/rules"] = (rules, None if response_lens is None else [len(response_lens)])
    return messages


# ------------------------------------------------------------------------------------------------ figures
def critic_figures_to_logger(figures: dict[str, float]) -> dict[str, float]:
    """The critic's training figures (CRITIC_FIGURES, on its leader) to the logging rank: there, those it logs;
    {} elsewhere. Every rank calls it.

    Route `figures/critic`: a gather over the trained ranks, the others sending NaNs that rank 0 drops (a group
    rank 0 belongs to anyway, rather than a point-to-point pair of its own on NCCL); on gloo, or with two trained
    ranks, the critic's leader sends them to rank 0 directly."""
    if not groups.plan().has("critic"):
        return {}
    path = route("figures/critic")
    me, critic = dist.get_rank(), groups.role_leader("critic")
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
