"""HFRolloutEngine on a tiny Llama (~20K parameters): what generate returns, that its log-probs are right, and that
its two decode loops (lean, and transformers' generate) sample from the same distribution."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.engines.rollout.base import RolloutBatch, RolloutError, SamplingParams, cut_at_stop
from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

PAD, BOS, EOS, STOP = 0, 1, 2, 3
VOCAB = 24
PROMPTS = [[BOS, 5, 6], [BOS, 7], [BOS, 9, 10, 11, 12, 13], [BOS, 4, 4, 8]]


def tiny_llama(seed: int, attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # A large init range makes the next-token distributions peaked, so stop tokens and repeats actually occur.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                         tie_word_embeddings=False, attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def engine(model):
    return HFRolloutEngine(model, pad_id=PAD, eos_id=EOS)


def teacher_forced_logprobs(model, prompt: list[int], response: torch.Tensor, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, response[:, None]).squeeze(1)


def assert_well_formed(batch: RolloutBatch, sampling: SamplingParams, stop_ids: set[int]):
    assert batch.num_prompts == len(PROMPTS)
    for per_prompt, lps, reasons in zip(batch.responses, batch.logprobs, batch.finish_reasons, strict=True):
        assert len(per_prompt) == len(lps) == len(reasons) == sampling.n
        for tokens, lp, reason in zip(per_prompt, lps, reasons, strict=True):
            assert tokens.dtype == torch.int64 and lp.dtype == torch.float32
            assert 1 <= len(tokens) <= sampling.max_new_tokens and tokens.shape == lp.shape
            assert bool((lp <= 0).all())
            inner_stops = [t for t in tokens[:-1].tolist() if t in stop_ids]
            assert inner_stops == [], "a response continues past a stop token"
            if reason == "stop":
                assert int(tokens[-1]) in stop_ids
            else:
                assert reason == "length" and len(tokens) == sampling.max_new_tokens
                assert int(tokens[-1]) not in stop_ids


# ------------------------------------------------------------------------------------------ pure helpers
def test_cut_at_stop_keeps_the_first_stop_token_and_drops_the_rest():
    row = torch.tensor([5, 7, 3, 0, 0])
    assert cut_at_stop(row, [2, 3], max_new_tokens=5) == (3, "stop")
    assert cut_at_stop(torch.tensor([2, 3, 3]), [3], max_new_tokens=3) == (2, "stop")
    assert cut_at_stop(torch.tensor([5, 7, 8]), [2, 3], max_new_tokens=3) == (3, "length")
    assert cut_at_stop(torch.tensor([5, 7, 8]), [], max_new_tokens=3) == (3, "length")


@pytest.mark.parametrize("bad, word", [(dict(n=0), "n must"), (dict(temperature=-1), "temperature"),
                                       (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                                       (dict(max_new_tokens=0), "max_new_tokens"),
                                       (dict(stop_token_ids=(-1,)), "stop_token_ids")])
def test_sampling_params_refuse_bad_values(bad, word):
    with pytest.raises(RolloutError, match=word):
        SamplingParams(**bad)


def test_bad_prompts_and_greedy_with_several_samples_are_refused(engine):
    with pytest.raises(RolloutError, match="prompt 1 is empty"):
        engine.generate([[BOS, 5], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(RolloutError, match="prompt 0 has token id 99"):
        engine.generate([[BOS, 99]], SamplingParams(max_new_tokens=2))
    with pytest.raises(RolloutError, match="greedy"):
        engine.generate([[BOS, 5]], SamplingParams(n=2, temperature=0.0))


# ------------------------------------------------------------------------------------------ generation
def test_n_samples_shapes_and_finish_reasons(engine):
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=0)
    batch = engine.generate(PROMPTS, sampling)
    assert_well_formed(batch, sampling, {EOS})
    assert batch.prompt_ids == PROMPTS
    flat = batch.flat_responses()
    assert len(flat) == 3 * len(PROMPTS) and flat[4] is batch.responses[1][1]
    assert batch.flat_finish_codes().tolist() == [0 if r == "stop" else 1 for rs in batch.finish_reasons for r in rs]
    # Three samples of the same prompt are drawn independently: not all identical.
    assert any(len({tuple(t.tolist()) for t in per_prompt}) > 1 for per_prompt in batch.responses)


def test_stop_tokens_end_responses_and_leave_no_padding(engine):
    free = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=3))
    stop_token = max(range(4, VOCAB), key=lambda t: sum(int((r == t).sum()) for r in free.flat_responses()))
    sampling = SamplingParams(n=4, max_new_tokens=12, stop_token_ids=(stop_token,), seed=3)
    batch = engine.generate(PROMPTS, sampling)
    assert_well_formed(batch, sampling, {EOS, stop_token})
    stopped = [t for t, r in zip(batch.flat_responses(), [r for rs in batch.finish_reasons for r in rs], strict=True)
               if r == "stop" and int(t[-1]) == stop_token]
    assert stopped, "the chosen stop token never ended a response"
    # Same seed and batch, so the streams agree up to (and including) the stop token.
    for before, after in zip(free.flat_responses(), batch.flat_responses(), strict=True):
        assert torch.equal(before[:len(after)], after)


def test_seeded_generation_repeats_and_leaves_the_callers_rng_alone(engine):
    sampling = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=8, seed=11)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = engine.generate(PROMPTS, sampling)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = engine.generate(PROMPTS, sampling)
    other = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=8, seed=12))
    for a, b in zip(first.flat_responses(), second.flat_responses(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first.flat_logprobs(), second.flat_logprobs(), strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(first.flat_responses(), other.flat_responses(), strict=True))


@pytest.mark.parametrize("decode_loop", ["lean", "generate"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0)])
def test_logprobs_equal_a_teacher_forced_pass_at_the_sampling_temperature(model, temperature, top_k, top_p,
                                                                          decode_loop):
    engine = HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop=decode_loop)
    n = 1 if temperature == 0 else 2
    sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=9, seed=5)
    batch = engine.generate(PROMPTS, sampling)
    t = 1.0 if temperature == 0 else temperature
    for prompt, responses, logprobs in zip(PROMPTS, batch.responses, batch.logprobs, strict=True):
        for response, lp in zip(responses, logprobs, strict=True):
            expected = teacher_forced_logprobs(model, prompt, response, t)
            torch.testing.assert_close(lp, expected, atol=2e-5, rtol=1e-5)
    if temperature == 0:  # greedy: every token is the argmax of its step
        for prompt, (response,) in zip(PROMPTS, batch.responses, strict=True):
            ids = torch.tensor([prompt + response.tolist()])
            with torch.no_grad():
                argmax = model(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1)
            assert torch.equal(argmax, response)


@pytest.mark.parametrize("decode_loop", ["lean", "generate"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_left_padding_gives_the_same_results_as_one_prompt_at_a_time(attn, decode_loop):
    model = tiny_llama(1, attn)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    batched = HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop=decode_loop).generate(PROMPTS, sampling)
    alone = HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, max_batch_prompts=1,
                            decode_loop=decode_loop).generate(PROMPTS, sampling)
    assert batched.finish_reasons == alone.finish_reasons
    for a, b in zip(batched.flat_responses(), alone.flat_responses(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(batched.flat_logprobs(), alone.flat_logprobs(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the two decode loops
def token_histograms(batch: RolloutBatch, positions: int) -> torch.Tensor:
    """[positions, VOCAB + 1] counts of the token at each response position over every sample (VOCAB: ended)."""
    counts = torch.zeros(positions, VOCAB + 1, dtype=torch.float64)
    for response in batch.flat_responses():
        for position in range(positions):
            counts[position, int(response[position]) if position < len(response) else VOCAB] += 1
    return counts


def chi_square_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's two-sample chi-square test of homogeneity on two histograms of the same bins; bins expected to
    hold fewer than 5 counts are merged into one, as the test's approximation needs."""
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    small = torch.minimum(expected_a, expected_b) < 5
    if small.any():
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
        total = a + b
        expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    keep = total > 0
    statistic = (((a - expected_a) ** 2 / expected_a)[keep].sum() + ((b - expected_b) ** 2 / expected_b)[keep].sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_both_decode_loops_sample_the_same_distribution_and_the_test_tells_another_temperature(model):
    """4,096 samples of four fixed prompts from each loop, drawn with different seeds: at each of the first four
    response positions the token histograms pass a chi-square test of homogeneity (p > 0.01); the lean loop at
    temperature 1.2 fails it at some position, so the test can tell distributions apart."""
    positions = 4
    prompts, n = PROMPTS, 1024

    def histograms(decode_loop: str, temperature: float, seed: int) -> torch.Tensor:
        engine = HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop=decode_loop)
        sampling = SamplingParams(n=n, temperature=temperature, max_new_tokens=positions, stop_token_ids=(STOP,),
                                  seed=seed)
        return token_histograms(engine.generate(prompts, sampling), positions)

    reference = histograms("generate", 1.0, seed=1)
    same = histograms("lean", 1.0, seed=2)
    hotter = histograms("lean", 1.2, seed=2)
    assert reference.sum() == same.sum() == 4096 * positions
    same_p = [chi_square_p_value(reference[k], same[k]) for k in range(positions)]
    hotter_p = [chi_square_p_value(reference[k], hotter[k]) for k in range(positions)]
    assert min(same_p) > 0.01, same_p
    assert min(hotter_p) < 0.01, hotter_p


def test_the_lean_loop_prefills_each_prompt_once_for_its_n_samples(model):
    shapes = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=3, seed=0)
        HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop="lean").generate(PROMPTS, sampling)
        lean = list(shapes)
        shapes.clear()
        HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop="generate").generate(PROMPTS, sampling)
    finally:
        hook.remove()
    width = max(len(p) for p in PROMPTS)
    assert lean[0] == (len(PROMPTS), width) and all(shape == (4 * len(PROMPTS), 1) for shape in lean[1:])
    assert shapes[0] == (4 * len(PROMPTS), width)  # transformers' generate prefills every copy of a prompt


def test_a_seeded_lean_loop_draws_what_generate_draws(model):
    """The same draws in the same order (one multinomial over the batch per step) from the same logits: a seeded
    lean rollout is transformers' seeded rollout, token for token."""
    sampling = SamplingParams(n=3, temperature=0.9, top_k=10, max_new_tokens=7, stop_token_ids=(STOP,), seed=3)
    lean = HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop="lean").generate(PROMPTS, sampling)
    reference = HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop="generate").generate(PROMPTS, sampling)
    assert lean.finish_reasons == reference.finish_reasons
    for a, b in zip(lean.flat_responses(), reference.flat_responses(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(lean.flat_logprobs(), reference.flat_logprobs(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_an_unknown_decode_loop_is_refused(model):
    with pytest.raises(RolloutError, match="decode_loop must be one of"):
        HFRolloutEngine(model, pad_id=PAD, eos_id=EOS, decode_loop="fast")


# ------------------------------------------------------------------------------------------ weights
def test_load_weights_then_generate_equals_a_model_built_with_those_weights():
    target = tiny_llama(7)
    engine = HFRolloutEngine(tiny_llama(8), pad_id=PAD, eos_id=EOS)
    reference = HFRolloutEngine(target, pad_id=PAD, eos_id=EOS)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    before = engine.generate(PROMPTS, sampling)
    # Sent as a stream of (name, tensor), half of them in another dtype: load_weights casts into place.
    loaded = engine.load_weights((name, t.double() if i % 2 else t) for i, (name, t) in
                                 enumerate(target.state_dict().items()))
    assert loaded == len(target.state_dict())
    after, expected = engine.generate(PROMPTS, sampling), reference.generate(PROMPTS, sampling)
    for a, b in zip(after.flat_responses(), expected.flat_responses(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(after.flat_logprobs(), expected.flat_logprobs(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(before.flat_responses(), after.flat_responses(), strict=True))


def test_adopted_weights_are_the_given_tensors_and_generate_as_loaded_ones():
    """adopt_weights (the weight sync's receive side for this engine) makes the parameters views of the given
    tensors, uncopied, where the dtype matches, and copies where it does not; the engine then generates exactly as
    one that loaded the same weights by copy."""
    target = tiny_llama(7)
    engine = HFRolloutEngine(tiny_llama(8), pad_id=PAD, eos_id=EOS)
    reference = HFRolloutEngine(target, pad_id=PAD, eos_id=EOS)
    buffer = torch.cat([p.detach().reshape(-1) for p in target.parameters()])  # one flat "received bucket"
    views, offset = [], 0
    for name, p in target.named_parameters():
        views.append((name, buffer[offset:offset + p.numel()].view(p.shape)))
        offset += p.numel()
    cast = views[1][0]
    views[1] = (cast, views[1][1].double())  # another dtype: copied into place
    done = engine.adopt_weights(views)
    assert done == {id(p) for p in engine.model.parameters()}
    params = dict(engine.model.named_parameters())
    for name, view in views:
        same_memory = params[name].data_ptr() == view.data_ptr()
        assert same_memory == (name != cast), name
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    after, expected = engine.generate(PROMPTS, sampling), reference.generate(PROMPTS, sampling)
    assert [t.tolist() for t in after.flat_responses()] == [t.tolist() for t in expected.flat_responses()]
    buffer.zero_()  # the next sync writes into the same memory: the adopted parameters see it
    assert all(float(params[name].abs().sum()) == 0 for name, _ in views if name != cast)
    with pytest.raises(RolloutError, match="adopt_weights: the model has no parameter or buffer named 'nope'"):
        engine.adopt_weights([("nope", torch.zeros(1))])


def test_after_each_adapter_sync_the_engine_generates_as_the_merged_actor():
    """LoRA RL's hf engine (issue 27): its own copy of the base with an adapter that each sync replaces generates,
    after each sync, the greedy tokens and sampling log-probs of the actor with that adapter merged into the
    weights."""
    from hpc_rlhf.config import LoraSection
    from hpc_rlhf.models.lora import adapter_tensors, apply_lora, merged_state_dict

    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    engine = HFRolloutEngine(apply_lora(tiny_llama(7), lora).requires_grad_(False).eval(), pad_id=PAD, eos_id=EOS)
    actor = apply_lora(tiny_llama(7), lora)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    sampled = SamplingParams(n=3, temperature=0.8, max_new_tokens=8, seed=5)
    seen = []
    for update in range(2):
        with torch.no_grad():  # an update of the actor: new adapter weights (B starts at zero in peft)
            for name, p in actor.named_parameters():
                if ".lora_" in name:
                    p.normal_(std=0.5)
        assert engine.load_adapter(adapter_tensors(actor)) == 12  # A and B of 3 layers x 2 layers
        merged = tiny_llama(0)
        merged.load_state_dict(merged_state_dict(actor))
        expected = HFRolloutEngine(merged, pad_id=PAD, eos_id=EOS)
        ours, theirs = engine.generate(PROMPTS, greedy), expected.generate(PROMPTS, greedy)
        assert [t.tolist() for t in ours.flat_responses()] == [t.tolist() for t in theirs.flat_responses()]
        for a, b in zip(ours.flat_logprobs(), theirs.flat_logprobs()):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        drawn = engine.generate(PROMPTS, sampled)
        for i, (tokens, lps) in enumerate(zip(drawn.flat_responses(), drawn.flat_logprobs())):
            teacher = teacher_forced_logprobs(merged, PROMPTS[i // 3], tokens, 0.8)
            torch.testing.assert_close(lps, teacher, atol=1e-4, rtol=0)
        seen.append([t.tolist() for t in ours.flat_responses()])
    assert seen[0] != seen[1]  # each sync changed what the engine generates
    with pytest.raises(RolloutError, match="load_adapter: the model has no parameter or buffer named"):
        engine.load_adapter([("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", torch.zeros(4, 32))])
    with pytest.raises(RolloutError, match="has no LoRA adapter"):
        HFRolloutEngine(tiny_llama(7), pad_id=PAD, eos_id=EOS).load_adapter(adapter_tensors(actor))


def test_load_weights_names_the_unknown_or_misshapen_tensor(engine):
    with pytest.raises(RolloutError, match=r"no parameter or buffer named 'model.layers.0.mlp.up_proj.weigth'.*"
                                           r"did you mean 'model.layers.0.mlp.up_proj.weight'"):
        engine.load_weights([("model.layers.0.mlp.up_proj.weigth", torch.zeros(64, 32))])
    with pytest.raises(RolloutError, match=r"'model.norm.weight' has shape \(32,\) in the model but \(31,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(31))])


def test_sleep_and_wake_keep_the_weights_on_cpu(engine, model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.sleep()
    engine.wake()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert engine.device.type == "cpu"


# ------------------------------------------------------------------------------------------ distributed
def test_zero3_sharded_model_generates_in_step_and_as_the_whole_model_would(tmp_path):
    """2 ranks, the model sharded with ZeRO-3 (nothing persistent), `sync_group` given: rank 0 has three prompt
    chunks and rank 1 none (it runs the same number of passes and drops them); rank 0's samples equal those of
    the whole model on one rank, and no rank ever had more than one module's parameters gathered."""
    import json

    from tests.distributed import run_ranks

    run_ranks(2, __file__, "sharded", str(tmp_path), timeout=150)
    result = json.loads((tmp_path / "sharded.json").read_text())
    assert result["same_as_whole"] and result["rank1_responses"] == 0
    assert 0 < result["most_gathered"] <= result["unit"] < result["model"]


def _sharded(out_dir: str):
    import json
    from pathlib import Path

    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from hpc_rlhf.engines import deepspeed_compat

    out = Path(out_dir)
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5)
    whole = HFRolloutEngine(tiny_llama(0), pad_id=PAD, eos_id=EOS, max_batch_prompts=2).generate(PROMPTS + PROMPTS[:1],
                                                                                               sampling)
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0}}
    with deepspeed_compat.keep_collectives_in_group(group):
        ds_engine, *_ = deepspeed.initialize(model=tiny_llama(0), config=config,
                                             mpu=deepspeed_compat.RoleMpu(group), dist_init_required=False)
    module = ds_engine.module
    deepspeed_compat.keep_module_in_group(module, group)
    most = [0]

    def record(*_):
        most[0] = max(most[0], sum(p.ds_numel for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE))

    for m in module.modules():
        m.register_forward_hook(record, prepend=True)  # before DeepSpeed releases the module
    engine = HFRolloutEngine(module, pad_id=PAD, eos_id=EOS, max_batch_prompts=2, sync_group=group)
    mine = PROMPTS + PROMPTS[:1] if rank == 0 else []  # 3 chunks of 2 prompts against none
    batch = engine.generate(mine, sampling)
    if rank == 0:
        same = all(torch.equal(a, b) for x, y in zip(batch.responses, whole.responses, strict=True)
                   for a, b in zip(x, y, strict=True)) and \
            all(torch.allclose(a, b, atol=1e-5) for x, y in zip(batch.logprobs, whole.logprobs, strict=True)
                for a, b in zip(x, y, strict=True))
        (out / "sharded.json").write_text(json.dumps({
            "same_as_whole": same, "rank1_responses": None, "most_gathered": most[0],
            "unit": max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in module.modules()),
            "model": sum(p.ds_numel for p in module.parameters())}))
    dist.barrier()
    if rank == 1:
        result = json.loads((out / "sharded.json").read_text())
        result["rank1_responses"] = batch.num_prompts
        (out / "sharded.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"sharded": _sharded})
