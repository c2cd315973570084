"""Phase 4 of the RL step, scoring (hpc_rlhf/rl/scoring.py): each rank's shard and passes, what the actor, ref, critic
and reward models compute on a tiny Llama against a hand computation, and the rule rewards on their one rank."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForTokenClassification

from hpc_rlhf.config import LoraSection
from hpc_rlhf.dist import exchange, groups
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.models.lora import apply_lora
from hpc_rlhf.models.tiny import load_tokenizer
from hpc_rlhf.models.value_model import set_reward_normalization
from hpc_rlhf.dist import watchdog
from hpc_rlhf.rewards import RewardFunctionError, exact_match
from hpc_rlhf.rl import scoring
from hpc_rlhf.rl.config import RewardSection
from hpc_rlhf.rl.batches import make_batch
from hpc_rlhf.rl.routes import Routes
from tests.reward_server import reward_server
from tests.models.conftest import tiny_config
from tests.recipes import one_rank_world

# Two samples of different lengths, so that the batch is padded and each response starts at its own position.
PROMPTS = [[1, 5, 6], [1, 7]]
RESPONSES = [torch.tensor([8, 9]), torch.tensor([10, 11, 12])]
PAD = 0


def tiny(model_class, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return model_class(tiny_config("llama", **overrides)).eval()


def unpadded(prompt: list[int], response: torch.Tensor) -> torch.Tensor:
    return torch.tensor([prompt + response.tolist()])


# ------------------------------------------------------------------------------------ shards and passes
def as_rank_of_role(monkeypatch, index: int, size: int, per_block: int = 1) -> list[dict]:
    """score_on_shard as group rank `index` of a role of `size` ranks (global ranks 0.., leader 0) in sequence
    blocks of `per_block` ranks: what it hands to the gather is recorded, and the leader gets its own results
    back as the gather's one rank."""
    first = index - index % per_block
    gathers = []

    def gather_ragged(seqs, dst, group, tag, dtype):
        gathers.append({"seqs": seqs, "dst": dst, "group": group, "tag": tag, "dtype": dtype})
        return [seqs] if index == dst else None

    monkeypatch.setattr(scoring, "groups", SimpleNamespace(
        role_ranks=lambda role: tuple(range(size)), rank_in_role=lambda role: index,
        role_leader=lambda role: 0, role_group=lambda role: f"group of {role}",
        sequence_ranks=lambda role: tuple(range(first, first + per_block))))
    monkeypatch.setattr(scoring, "exchange", SimpleNamespace(gather_ragged=gather_ragged,
                                                             flatten_ranks=exchange.flatten_ranks))
    return gathers


@pytest.mark.parametrize("samples, micro, index, passes, kept", [
    # 7 samples on 3 ranks: shards [0, 3), [3, 5), [5, 7); the largest takes 2 passes of 2, so every rank does
    (7, 2, 0, [(0, 2), (2, 3)], [0, 1, 2]),
    (7, 2, 1, [(3, 5), (0, 1)], [3, 4]),  # its second pass: on sample 0, dropped
    (7, 2, 2, [(5, 7), (0, 1)], [5, 6]),
    (7, 4, 1, [(3, 5)], [3, 4]),  # micro-batches of 4: one pass each
    (2, 4, 2, [(0, 1)], []),  # 2 samples on 3 ranks: the third has none and still runs its one pass
])
def test_each_rank_scores_its_shard_in_as_many_passes_as_the_largest_shard(monkeypatch, samples, micro, index,
                                                                             passes, kept):
    gathers = as_rank_of_role(monkeypatch, index, size=3)
    seen = []

    def one(bounds):
        seen.append(bounds)
        return [torch.tensor([float(i)]) for i in range(*bounds)]

    got = scoring.score_on_shard("critic", samples, micro, lambda lo, hi: (lo, hi), one)
    assert seen == passes
    [gather] = gathers
    assert [float(t) for t in gather["seqs"]] == kept
    assert (gather["dst"], gather["group"], gather["tag"], gather["dtype"]) == (0, "group of critic", "critic-scores",
                                                                              torch.float32)
    assert got == (gather["seqs"] if index == 0 else None)


@pytest.mark.parametrize("index, passes, kept", [
    # 7 samples on 4 ranks in blocks of 2 (critic_sp=2): the blocks take [0, 4) and [4, 7) in two passes of 2,
    # both ranks of a block on the same rows; only a block's first rank hands its results on
    (0, [(0, 2), (2, 4)], [0, 1, 2, 3]),
    (1, [(0, 2), (2, 4)], []),
    (2, [(4, 6), (6, 7)], [4, 5, 6]),
    (3, [(4, 6), (6, 7)], []),
])
def test_a_sequence_block_scores_one_shard_together(monkeypatch, index, passes, kept):
    gathers = as_rank_of_role(monkeypatch, index, size=4, per_block=2)
    seen = []

    def one(bounds):
        seen.append(bounds)
        return [torch.tensor([float(i)]) for i in range(*bounds)]

    scoring.score_on_shard("critic", 7, 2, lambda lo, hi: (lo, hi), one)
    assert seen == passes
    assert [float(t) for t in gathers[0]["seqs"]] == kept


def test_a_result_computed_for_another_role_is_tagged_with_its_own_name(monkeypatch):
    """The reference of a LoRA actor is scored on the actor's ranks, in the actor's group, as `ref`."""
    gathers = as_rank_of_role(monkeypatch, 0, size=2)
    scoring.score_on_shard("actor", 4, 2, lambda lo, hi: (lo, hi), lambda b: [torch.zeros(1)] * (b[1] - b[0]), "ref")
    assert (gathers[0]["group"], gathers[0]["tag"]) == ("group of actor", "ref-scores")


@pytest.fixture
def actor_alone():
    one_rank_world()
    groups.initialize(make_plan("actor=1", 1, 1))
    yield
    groups.destroy()


def test_on_one_rank_the_leader_gets_every_result_in_sample_order(actor_alone):
    """Through the real gather on a one-rank world, over 3 passes: results of any length, none included."""
    def one(bounds):
        return [torch.full((i % 3,), float(i)) for i in range(*bounds)]

    got = scoring.score_on_shard("actor", 5, 2, lambda lo, hi: (lo, hi), one)
    assert [t.tolist() for t in got] == [[], [1.0], [2.0, 2.0], [], [4.0]]


def test_score_roles_builds_the_micro_batches_and_scores_a_result_on_the_role_that_computes_it(actor_alone):
    """`ref` computed by the actor's ranks (ref_mode=adapter_disabled): both on the actor's one rank, each sample's
    prompt and response in its padded micro-batch."""
    def lengths(sub):
        return [torch.tensor([float(p), float(r)]) for p, r in zip(sub.prompt_lens, sub.response_lens)]

    def first_response_token(sub):
        return [sub.input_ids[i, p:p + 1].float() for i, p in enumerate(sub.prompt_lens)]

    got = scoring.score_roles({"actor": lengths, "ref": first_response_token}, PROMPTS, RESPONSES, PAD, micro=1,
                              device="cpu", computed_by={"ref": "actor"})
    assert [t.tolist() for t in got["actor"]] == [[3.0, 2.0], [2.0, 3.0]]
    assert [t.tolist() for t in got["ref"]] == [[8.0], [10.0]]


def test_micro_batches_by_tokens_score_in_sample_order_and_a_rank_without_scorers_needs_no_responses(actor_alone):
    """rl.score_micro_batch_tokens: micro-batches of at most 7 tokens (PROMPTS + RESPONSES are 5 each: one sample
    a pass), the results in sample order; a rollout engine's rank scores nothing and holds no responses."""
    seen = []

    def lengths(sub):
        seen.append(len(sub.prompt_lens))
        return [torch.tensor([float(p), float(r)]) for p, r in zip(sub.prompt_lens, sub.response_lens)]

    got = scoring.score_roles({"actor": lengths}, PROMPTS, RESPONSES, PAD, micro=2, device="cpu", micro_tokens=7)
    assert [t.tolist() for t in got["actor"]] == [[3.0, 2.0], [2.0, 3.0]] and seen == [1, 1]
    assert scoring.score_roles({}, PROMPTS, None, PAD, micro=2, device="cpu", micro_tokens=7) == {}


# ------------------------------------------------------------------------------ what each role computes
def test_logprobs_are_those_of_the_sampling_distribution_at_the_response_tokens():
    """log softmax(logits / T) at each response token, from the position before it, as the engines sample."""
    model = tiny(LlamaForCausalLM)
    got = scoring.logprobs_of(model, temperature=0.7)(make_batch(PROMPTS, RESPONSES, PAD))
    for prompt, response, logprobs in zip(PROMPTS, RESPONSES, got, strict=True):
        with torch.no_grad():
            logits = model(input_ids=unpadded(prompt, response)).logits[0]
        predicting = logits[len(prompt) - 1:-1]  # position t predicts token t + 1
        want = torch.log_softmax(predicting / 0.7, dim=-1).gather(1, response[:, None]).squeeze(1)
        assert logprobs.shape == response.shape and torch.allclose(logprobs, want, atol=1e-5)


def test_the_reference_of_a_lora_actor_is_its_base_model():
    """adapter_off: the actor's own module with its adapter disabled scores as the model it was made from."""
    base = tiny(LlamaForCausalLM)
    actor = apply_lora(tiny(LlamaForCausalLM), LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in actor.named_parameters():
            if "lora_B" in name:  # zero at first: the adapter would change nothing
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    batch = make_batch(PROMPTS, RESPONSES, PAD)
    plain = scoring.logprobs_of(base, temperature=1.0)(batch)
    reference = scoring.logprobs_of(actor, temperature=1.0, adapter_off=True)(batch)
    adapted = scoring.logprobs_of(actor, temperature=1.0)(batch)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(reference, plain, strict=True))
    assert not any(torch.allclose(a, b, atol=1e-3) for a, b in zip(adapted, plain, strict=True))


def test_values_are_the_critics_at_the_positions_that_predict_the_response_tokens():
    critic = tiny(LlamaForTokenClassification, num_labels=1)
    got = scoring.values_of(critic)(make_batch(PROMPTS, RESPONSES, PAD))
    for prompt, response, values in zip(PROMPTS, RESPONSES, got, strict=True):
        with torch.no_grad():
            per_token = critic(input_ids=unpadded(prompt, response)).logits[0, :, 0]
        want = per_token[len(prompt) - 1:len(prompt) - 1 + len(response)]
        assert values.shape == response.shape and torch.allclose(values, want, atol=1e-5)


def test_a_reward_models_score_is_its_value_at_the_last_token_normalised_when_asked():
    reward_model = tiny(LlamaForTokenClassification, seed=1, num_labels=1)
    set_reward_normalization(reward_model, mean=0.5, std=2.0)
    batch = make_batch(PROMPTS, RESPONSES, PAD)
    raw = scoring.scores_of(reward_model, normalize=False)(batch)
    normalised = scoring.scores_of(reward_model, normalize=True)(batch)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        with torch.no_grad():
            last = reward_model(input_ids=unpadded(prompt, response)).logits[0, -1, 0].reshape(1)
        assert raw[i].shape == (1,) and torch.allclose(raw[i], last, atol=1e-5)
        assert torch.allclose(normalised[i], (last - 0.5) / 2.0, atol=1e-5)


# ------------------------------------------------------------------------------------------ rule rewards
@pytest.fixture
def remote_reward():
    """A remote reward: 1 for each response that ends with the end-of-sequence text."""
    with reward_server(lambda response: float(response.endswith("<eos>"))) as url:
        yield url


def test_rule_rewards_are_weighted_and_summed_on_the_rule_rank_only(monkeypatch, remote_reward):
    """The rule rank (the reward model's leader, rank 2) decodes the responses, special tokens kept, and sums each
    rule function and the endpoint with their weights; the other ranks compute nothing."""
    routes = Routes(make_plan("actor=1,critic=1,reward=1,rollout=1", 4, 4))
    tokenizer = load_tokenizer()
    eos = torch.tensor([tokenizer.eos_token_id])
    responses = [torch.cat([torch.tensor(tokenizer.encode(text, add_special_tokens=False)), eos])
                 for text in ("42", "7")] + [torch.tensor(tokenizer.encode("42 is it", add_special_tokens=False))]

    def characters(prompts, texts, answers):
        return [float(len(t)) for t in texts]

    cfg = SimpleNamespace(reward=RewardSection(function_weights=[0.5, 2.0], http_url=remote_reward, http_weight=3.0))
    rules = [("characters", characters), ("exact_match", exact_match)]
    prompts, answers = ["40+2=", "3+4=", "40+2="], ["42", "8", "42"]

    monkeypatch.setattr(scoring, "dist", SimpleNamespace(get_rank=lambda: 2))
    [total] = scoring.rule_scores(routes, cfg, rules, tokenizer, prompts, responses, answers)
    # "42<eos>": 0.5 * 7 characters + 2 * right + 3 * ended; "7<eos>": 0.5 * 6 + 3; "42 is it": 0.5 * 8
    assert total.tolist() == [3.5 + 2.0 + 3.0, 3.0 + 3.0, 4.0]
    monkeypatch.setattr(scoring, "dist", SimpleNamespace(get_rank=lambda: 0))
    assert scoring.rule_scores(routes, cfg, rules, tokenizer, prompts, None, answers) is None


def test_rule_functions_weigh_one_each_unless_weighted(monkeypatch):
    routes = Routes(make_plan("actor=1,rollout=1", 2, 2))  # no reward model: the actor's leader, rank 0
    monkeypatch.setattr(scoring, "dist", SimpleNamespace(get_rank=lambda: 0))
    cfg = SimpleNamespace(reward=RewardSection())
    rules = [("one", lambda p, r, a: [1.0] * len(r)), ("two", lambda p, r, a: [2.0] * len(r))]
    responses = [torch.tensor([10]), torch.tensor([11])]
    [total] = scoring.rule_scores(routes, cfg, rules, load_tokenizer(), ["p", "q"], responses, [None, None])
    assert total.tolist() == [3.0, 3.0]


def test_a_weight_that_takes_a_rule_reward_past_float32_names_the_function(monkeypatch):
    routes = Routes(make_plan("actor=1,rollout=1", 2, 2))
    monkeypatch.setattr(scoring, "dist", SimpleNamespace(get_rank=lambda: 0))
    cfg = SimpleNamespace(reward=RewardSection(function_weights=[1e10]))
    rules = [("big", lambda p, r, a: [1.0, 1e30])]
    with pytest.raises(RewardFunctionError, match=r"^reward function 'big' gave response 1 the reward inf after "
                                                  r"weighting"):
        scoring.rule_scores(routes, cfg, rules, load_tokenizer(), ["p", "q"], [torch.tensor([10])] * 2, [None] * 2)


def test_the_remote_call_runs_in_a_watchdog_phase_that_names_the_endpoint(monkeypatch):
    """If the job dies while this rank waits on the endpoint, its heartbeat and failure line name the endpoint."""
    routes = Routes(make_plan("actor=1,rollout=1", 2, 2))
    monkeypatch.setattr(scoring, "dist", SimpleNamespace(get_rank=lambda: 0))
    phases = []

    def remote(url, prompts, texts, answers, **limits):
        phases.append(watchdog.current_phase())
        return [1.0] * len(texts)

    monkeypatch.setattr(scoring.reward_fns, "remote_rewards", remote)
    cfg = SimpleNamespace(reward=RewardSection(http_url="http://judge:8000/score?token=secret"))
    with watchdog.phase("scoring"):
        [total] = scoring.rule_scores(routes, cfg, [], load_tokenizer(), ["p"], [torch.tensor([10])], [None])
        assert watchdog.current_phase() == "scoring"
    assert total.tolist() == [1.0]
    assert phases == ["scoring (waiting on reward endpoint http://judge:8000/score?...)"]


def test_a_reward_models_weighted_score_past_float32_names_the_model():
    cfg = SimpleNamespace(reward=RewardSection(models=["runs/rm/final", "runs/rm2"], model_weights=[1.0, 1e10]))
    scored = {"rules": torch.zeros(2), "reward": torch.ones(2), "reward2": torch.tensor([0.5, 1e30])}
    with pytest.raises(RewardFunctionError, match=r"^reward model runs/rm2 \(role reward2, weight 1e\+10\) gave "
                                                  r"response 1 the reward inf after weighting"):
        scoring.check_model_scores(cfg, scored)
    scored["reward2"] = torch.tensor([0.5, 3e28])  # each finite after weighting, their sum is not
    scored["reward"] = torch.tensor([0.0, 3e38])
    with pytest.raises(RewardFunctionError, match=r"^the sum of the rewards .* gave response 1 the reward inf"):
        scoring.check_model_scores(cfg, scored)
    scoring.check_model_scores(cfg, {"rules": torch.zeros(2)})  # roles this rank does not hold: nothing to check
