"""Experience messages of the RL step, each to the ranks that consume it (DESIGN §4.3).

A message kind has a route (`hpc_rlhf.dist.groups.route`): its sender and its consumers, a pure function of the
placement. A message travels nowhere when its sender is its only consumer, point to point to a single consumer
(and on gloo, to each consumer when it is at most DIRECT_MAX_BYTES: `_post` says why), by broadcast over the
route's group otherwise; ranks outside the route take no part and get None.

On a machine where roles share cores, a message costs a rank far more in latency (its partner must be scheduled)
than in bytes, so the messages of one phase travel together, all in flight before any is waited for:
`share_responses` moves a batch's responses and sampling log-probs from every engine in one round (padded to a
size every rank knows), `share_known` a step's scores from every role in one (their lengths follow from the
responses, and what one sender sends to the same ranks goes as one message).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.dist import exchange, groups

DIRECT_MAX_BYTES = 1 << 20  # up to this size a message goes to each consumer directly (see _post)


def share_known(messages: Mapping[str, tuple[Sequence[torch.Tensor] | None, Sequence[int] | None]],
                dtype: torch.dtype = torch.float32) -> dict[str, list[torch.Tensor] | None]:
    """Several messages of known lengths at once: `messages[key] = (values, lengths)` for route `key`, `values`
    given on the route's sender, `lengths` (of every value) on every rank of the route; the result maps each key
    to its values on the ranks of its route, None elsewhere. Every rank passes the same keys in the same order.

    Messages whose routes have the same sender and ranks travel as one flat message, and every message is in
    flight before any is waited for (`_post`): a rank that consumes several messages waits for the slowest, not
    for their sum."""
    me = dist.get_rank()
    out: dict[str, list[torch.Tensor] | None] = {key: None for key in messages}
    bundles: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, (values, lengths) in messages.items():
        path = groups.route(key)
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
        works += _post(flat, groups.route(keys[0]), tag=order[keys[0]])
    _wait(works)
    for keys, flat in zip(bundles.values(), flats):
        sizes = [sum(messages[key][1]) for key in keys]
        for key, part in zip(keys, torch.split(flat.cpu(), sizes)):
            out[key] = list(torch.split(part, list(messages[key][1])))
    return out


def _post(flat: torch.Tensor, path: groups.Route, tag: int) -> list:
    """Start moving `flat` along `path` (this rank is on it): the works to wait for, none if nothing travels.

    A small message on gloo goes from its sender to each consumer directly. gloo runs a broadcast on the group's
    worker thread, along a binomial tree (a consumer can get the message through another consumer), so each
    message waits for one or two more threads to be scheduled; where roles share cores that is what a message of
    a few kilobytes costs. Large messages, and any message on NCCL, take the group's broadcast."""
    me = dist.get_rank()
    if len(path.ranks) == 1 or not flat.numel():
        return []
    direct = len(path.ranks) == 2 or (flat.device.type == "cpu"
                                      and flat.numel() * flat.element_size() <= DIRECT_MAX_BYTES)
    if not direct:
        return [dist.broadcast(flat, path.src, group=groups.route_group(path.key), async_op=True)]
    if me == path.src:
        return [dist.isend(flat, other, tag=tag) for other in path.consumers]
    return [dist.irecv(flat, path.src, tag=tag)]


def _wait(works) -> None:
    for work in works:
        work.wait()


def share_responses(mine: Sequence[torch.Tensor] | None, mine_logps: Sequence[torch.Tensor] | None, kind: str,
                    counts: Sequence[int], max_len: int, with_logprobs: bool = False
                    ) -> tuple[list[list[torch.Tensor] | None], list[list[torch.Tensor] | None]]:
    """Every engine's responses (`mine`: token ids, on the engine's first rank; engine E generated `counts[E]`
    responses of at most `max_len` tokens) along the routes `kind/E`, with `with_logprobs` their sampling
    log-probs (`mine_logps`) too: per engine, (token ids, log-probs) on the ranks of its route, None elsewhere.
    Every rank calls it.

    One message per engine, all in flight at once, of a size every rank knows: 4-byte words, the lengths, then
    room for `max_len` token ids (int32: vocabularies are far below 2^31) per response, then as much for the
    log-probs' bits. Padding to the longest possible batch costs bytes, which are cheap next to the round trip
    that announcing the size would cost; the log-probs ride in the room int64 ids would have taken, so the
    ranks that do not need them (ref, reward) get no more bytes than the ids alone would have cost them."""
    device, me = exchange.comm_device(), dist.get_rank()
    width = 2 if with_logprobs else 1
    tokens: list[list[torch.Tensor] | None] = [None] * len(counts)
    logps: list[list[torch.Tensor] | None] = [None] * len(counts)
    words, works = {}, []
    for e, count in enumerate(counts):
        key = f"{kind}/{e}"
        path = groups.route(key)
        if me not in path.ranks:
            continue
        room = count * max_len
        words[e] = torch.zeros(count + width * room, dtype=torch.int32)
        if me == path.src:
            lengths = [len(t) for t in mine] if mine is not None else None
            if lengths is None or len(lengths) != count or (lengths and max(lengths) > max_len):
                raise exchange.ExchangeError(f"share_responses('{key}'): the engine has {len(lengths or [])} "
                                             f"responses of up to {max(lengths or [0])} tokens; the ranks of the "
                                             f"route expect {count} of at most {max_len}")
            if with_logprobs and (mine_logps is None or [len(t) for t in mine_logps] != lengths):
                raise exchange.ExchangeError(f"share_responses('{key}'): log-probs missing or not as long as the "
                                             "responses")
            flat, _ = exchange.pack_ragged(mine, torch.long)
            if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < 2**31):
                raise exchange.ExchangeError(f"share_responses('{key}'): token ids outside int32")
            total = flat.numel()
            words[e][:count] = torch.tensor(lengths, dtype=torch.int32)
            words[e][count:count + total] = flat.to(torch.int32)
            if with_logprobs:
                logp_bits = exchange.pack_ragged(mine_logps, torch.float32)[0].view(torch.int32)
                words[e][count + room:count + room + total] = logp_bits
        words[e] = words[e].to(device)
        works += _post(words[e], path, tag=e)
    _wait(works)
    for e, flat in words.items():
        count, room = counts[e], counts[e] * max_len
        flat = flat.cpu()
        lengths = flat[:count].tolist()
        total = sum(lengths)
        tokens[e] = list(torch.split(flat[count:count + total].long(), lengths))
        if with_logprobs:
            logps[e] = list(torch.split(flat[count + room:count + room + total].view(torch.float32).clone(), lengths))
    return tokens, logps


def concatenated(per_engine: list[list[torch.Tensor] | None]) -> list[torch.Tensor] | None:
    """The engines' lists in engine order, on the ranks that got every one of them; None elsewhere."""
    if any(part is None for part in per_engine):
        return None
    return [t for part in per_engine for t in part]
