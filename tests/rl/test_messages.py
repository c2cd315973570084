"""The RL step's messages: the calls that move a step's responses and scores along its routes, on 6 gloo ranks (the
worker code is at the bottom of this file; the route table itself is tested in test_routes.py)."""

from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.rl import messages, routes
from tests.distributed import run_ranks, run_worker

# 6 ranks as 2 nodes of 3: actor+ref 0-1, reward 2, critic 3, rollout 4-5 (one engine of 2).
COLOCATED = ("actor+ref=2,critic=1,reward=1,rollout=2,rollout_tp=2", 6, 3)


def test_a_steps_messages_on_six_ranks_both_ways():
    proc = run_ranks(6, __file__, "messages", timeout=150)
    assert proc.stdout.count("messages ok") == 6, proc.stdout


def _messages_worker():
    import torch
    import torch.distributed as dist

    from hpc_rlhf.dist import exchange, groups
    from hpc_rlhf.rl.batches import EPISODE_FIELDS, Generated

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 6
    plan = make_plan(*COLOCATED)
    table = routes.Routes(plan)
    groups.initialize(plan, table.message_groups(), timeout_s=60)

    # Both ways a message travels: each consumer directly from its sender (small messages on gloo), and the route
    # group's broadcast (large ones; DIRECT_MAX_BYTES = 0 sends everything that way).
    real_broadcast, broadcasts = dist.broadcast, []

    def counted_broadcast(*args, **kwargs):
        broadcasts.append(args)
        return real_broadcast(*args, **kwargs)

    dist.broadcast = counted_broadcast
    real_direct_max = exchange.DIRECT_MAX_BYTES
    for direct_max in (exchange.DIRECT_MAX_BYTES, 0):
        exchange.DIRECT_MAX_BYTES = direct_max
        broadcasts.clear()
        # A step's scores in one round (share_known): per-token results of actor and ref from rank 0 (one message:
        # same sender, same ranks), the critic's from rank 3, reward and rule scores from rank 2, each on exactly
        # the ranks of its route. Every rank rebuilds what each sender sends from a seed.
        lengths = {"scores/actor": [3, 0, 2], "scores/critic": [3, 0, 2], "scores/ref": [3, 0, 2],
                   "scores/reward": [1, 1, 1], "scores/rules": [1, 1, 1]}

        def sent(key):
            g = torch.Generator().manual_seed(len(key) * 31 + sum(map(ord, key)))
            return [torch.randn(n, generator=g) for n in lengths[key]]

        paths = {key: table[key] for key in lengths}
        sending = {key: (sent(key) if rank == paths[key].src else None,
                         lengths[key] if rank in paths[key].ranks else None) for key in lengths}
        got = messages.share_known(table, sending)
        for key, route in paths.items():
            if rank in route.ranks:
                assert [torch.equal(a, b) for a, b in zip(got[key], sent(key), strict=True)] == [True] * 3, key
            else:
                assert got[key] is None, (key, rank)

        # A batch's responses with their sampling log-probs (share_responses), from engine 0's first rank (4) to
        # the scoring ranks 0-3, bit for bit, token ids above 2^16 included; not to rank 5 nor back to rank 4 (the
        # engine's leader sends them and consumes none). Episodes: with their
        # model-token masks and figures, so that the trajectories rebuilt there are the engine's, token for token.
        for episodes in (False, True):
            g = torch.Generator().manual_seed(5)
            want = Generated([torch.randint(0, 2**31 - 1, (n,), generator=g) for n in (4, 0, 7, 1)])
            want.logprobs = [-torch.rand(len(t), generator=g) * 9 for t in want.responses]
            if episodes:
                want.masks = [torch.rand(len(t), generator=g) > 0.4 for t in want.responses]
                want.episodes = torch.randn(4, len(EPISODE_FIELDS), generator=g)
            got = messages.share_responses(table, want if rank == 4 else None, "responses", counts=[4], max_len=7,
                                           with_logprobs=True, with_episodes=episodes)
            if rank >= 4:
                assert got == [None]
                continue
            for name in ("responses", "logprobs") + (("masks",) if episodes else ()):
                pairs = zip(getattr(got[0], name), getattr(want, name), strict=True)
                assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in pairs), (name, got[0])
            assert (got[0].masks is None) == (not episodes)
            assert not episodes or torch.equal(got[0].episodes, want.episodes)

        # The critic's figures reach the logging rank (0) from the critic's leader (3), without its skip flag.
        figures = {"value_loss": 0.5, "value_clip_fraction": 0.25, "critic_grad_norm": 2.0, "critic_skipped": 1.0}
        logged = messages.critic_figures_to_logger(table, figures if rank == 3 else {})
        assert logged == ({k: v for k, v in figures.items() if k != "critic_skipped"} if rank == 0 else {}), logged
        # Direct: no broadcast at all. Broadcast: every rank on a route of three ranks or more (0-4) takes part.
        assert bool(broadcasts) == (not direct_max and rank <= 4), (direct_max, len(broadcasts))
    dist.broadcast = real_broadcast
    groups.destroy()

    # ------------------------------------------------------------------ three engines: 0-1 actor, 2 critic, 3-5
    # The engines' first ranks (3, 4, 5) gather their shares to the hub (3), which sends the batch to the consumers
    # (0-2): over groups (DIRECT_MAX_BYTES = 0, as NCCL does), or each engine to each consumer directly (gloo).
    engines_plan = make_plan("actor=2,critic=1,rollout=3", 6, 6)
    table = routes.Routes(engines_plan)
    groups.initialize(engines_plan, table.message_groups(), timeout_s=60)
    real_gather, gathers = dist.gather, []

    def counted_gather(*args, **kwargs):
        gathers.append(args)
        return real_gather(*args, **kwargs)

    dist.gather = counted_gather
    for direct_max in (real_direct_max, 0):
        exchange.DIRECT_MAX_BYTES = direct_max
        gathers.clear()
        g = torch.Generator().manual_seed(11)
        shares = [[torch.randint(0, 50, (n,), generator=g) for n in lengths] for lengths in ([3, 1], [2], [4, 0, 4])]
        logps = [[-torch.rand(len(t), generator=g) for t in share] for share in shares]
        mine = Generated(shares[rank - 3], logps[rank - 3]) if rank >= 3 else None
        got = messages.share_responses(table, mine, "responses", counts=[2, 1, 3], max_len=4, with_logprobs=True)
        if rank <= 2:
            for e in range(3):
                assert all(torch.equal(a, b) for a, b in zip(got[e].responses, shares[e], strict=True)), (e, got)
                assert all(torch.equal(a, b) for a, b in zip(got[e].logprobs, logps[e], strict=True)), (e, got)
        else:
            assert got == [None] * 3
        # Evaluation: to rank 0 alone.
        got = messages.share_responses(table, mine, "eval", counts=[2, 1, 3], max_len=4)
        assert (got == [None] * 3) == (rank != 0)
        if rank == 0:
            assert all(torch.equal(a, b) for e in range(3) for a, b in zip(got[e].responses, shares[e], strict=True))
        # The critic's figures: a gather over the trained ranks 0-2 (or directly from rank 2 on gloo).
        figures = {"value_loss": 0.5, "value_clip_fraction": 0.25, "critic_grad_norm": 2.0, "critic_skipped": 0.0}
        logged = messages.critic_figures_to_logger(table, figures if rank == 2 else {})
        assert logged == ({k: v for k, v in figures.items() if k != "critic_skipped"} if rank == 0 else {}), logged
        # Gathers: the hub's of the engines' shares (ranks 3-5, twice) and the figures' (ranks 0-2), groups only.
        assert len(gathers) == (0 if direct_max else 2 if rank >= 3 else 1), (direct_max, len(gathers))
    dist.gather = real_gather
    groups.destroy()

    # ------------------------------------------------------------------ hybrid: engines [0, 1] and [2, 3] on the
    # actor's ranks, critic 4-5. The hub (rank 0) generates and scores: it keeps the batch, and engine 1's share
    # reaches it too (from rank 2, directly or over the engines' group).
    hybrid = make_plan("actor=4,critic=2,rollout@actor,rollout_tp=2", 6, 6)
    table = routes.Routes(hybrid)
    groups.initialize(hybrid, table.message_groups(), timeout_s=60)
    for direct_max in (real_direct_max, 0):
        exchange.DIRECT_MAX_BYTES = direct_max
        g = torch.Generator().manual_seed(13)
        shares = [[torch.randint(0, 50, (n,), generator=g) for n in lengths] for lengths in ([2, 3], [1, 4])]
        engine = {0: 0, 2: 1}.get(rank)
        mine = Generated(shares[engine]) if engine is not None else None
        got = messages.share_responses(table, mine, "responses", counts=[2, 2], max_len=4)
        for e in range(2):  # every rank scores
            assert all(torch.equal(a, b) for a, b in zip(got[e].responses, shares[e], strict=True)), (rank, e, got)
        got = messages.share_responses(table, mine, "eval", counts=[2, 2], max_len=4)
        assert (got == [None, None]) == (rank != 0)
        if rank == 0:
            assert all(torch.equal(a, b) for e in range(2) for a, b in zip(got[e].responses, shares[e], strict=True))
    exchange.DIRECT_MAX_BYTES = real_direct_max
    dist.barrier()
    groups.destroy()
    print(f"rank {rank}: messages ok", flush=True)


if __name__ == "__main__":
    run_worker({"messages": _messages_worker}, timeout_s=60)
