"""What the RL recipe (rl/step.py) optimises and logs, checked against the formulas it claims: the
options that would train something other than they say are refused, the actor scores at the sampling
temperature (so its log-probs equal the engine's), and the figures are logged apart and by name."""

from __future__ import annotations

import json
import re

import pytest

from hpc_rlhf.config import TINY_ASSETS, ConfigError, load_config
from hpc_rlhf.rl import grpo, ppo
from hpc_rlhf.utils.metrics import is_wall_clock, read_metrics
from tests.distributed import hpc_rlhf_cli
from tests.recipes import QUIET

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"


@pytest.mark.parametrize("override, message", [
    ("rl.clip_eps=0", "rl.clip_eps must be > 0, got 0"),
    ("rl.value_clip_eps=0", "rl.value_clip_eps must be > 0, got 0"),
    ("rl.dual_clip=1", "rl.dual_clip must be > 1, got 1"),
    ("rl.clip_eps_high=0", "rl.clip_eps_high must be > 0, got 0"),
    ("rl.tis_cap=0", "rl.tis_cap must be > 0, got 0"),
])
def test_bounds_the_losses_would_reject_are_refused_at_configuration(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ppo.Config, None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["rl.policy_loss=gspo", "rl.is_correction=tis_token"],
     "rl.policy_loss=gspo weighs whole responses by their sequence ratio, but rl.is_correction=tis_token"),
    (["rl.policy_loss=gspo", "rl.loss_agg=seq-mean-token-sum"], "rl.policy_loss=gspo takes rl.loss_agg"),
    (["rl.policy_loss=cispo", "rl.dual_clip=3"], "rl.dual_clip bounds PPO's token loss; rl.policy_loss=cispo"),
    (["rl.dynamic_sampling=true", "rl.advantage=reinforce_pp"], "rl.dynamic_sampling drops prompts .* not "
                                                                "rl.advantage=reinforce_pp"),
    (["rl.is_correction=mis_seq", "rl.tis_cap=2"], "rl.tis_cap=2.0 truncates importance weights, which "
                                                   "rl.is_correction=mis_seq does not do"),
    (["rl.is_correction=tis_seq", "rl.is_high=3"], "rl.is_low/rl.is_high bound masked importance sampling"),
    (["rl.is_correction=mis_token", "rl.is_high=0.5"], "needs 0 <= rl.is_low < 1 < rl.is_high"),
    (["rl.overlong_buffer=9"], "rl.overlong_buffer=9 is longer than rollout.max_new_tokens=6"),
])
def test_rlvr_combinations_that_say_nothing_are_refused_naming_both_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(grpo.Config, None, ["rollout.max_new_tokens=6", *overrides])


def test_dynamic_sampling_with_a_critic_is_refused():
    with pytest.raises(ConfigError, match="not rl.advantage=gae"):
        load_config(ppo.Config, None, ["rl.dynamic_sampling=true"])


def test_auto_correction_is_todays_token_tis_and_its_sequence_form_for_gspo():
    from hpc_rlhf.rl.config import clip_range, is_correction

    def rl(*overrides):
        return load_config(grpo.Config, None, list(overrides)).rl

    assert is_correction(rl()) == ("none", {})
    assert is_correction(rl("rl.max_staleness=1")) == ("tis_token", {"cap": 2.0})
    assert is_correction(rl("rl.tis_cap=1.5")) == ("tis_token", {"cap": 1.5})
    assert is_correction(rl("rl.max_staleness=1", "rl.policy_loss=gspo")) == ("tis_seq", {"cap": 2.0})
    assert is_correction(rl("rl.is_correction=mis_token")) == ("mis_token", {"is_low": 0.5, "is_high": 2.0})
    assert clip_range(rl()) == (0.2, None)
    assert clip_range(rl("rl.policy_loss=gspo")) == (3e-4, 4e-4)
    assert clip_range(rl("rl.policy_loss=gspo", "rl.clip_eps=1e-3")) == (1e-3, None)
    assert clip_range(rl("rl.clip_eps_high=0.28")) == (0.2, 0.28)


def test_each_policy_loss_defaults_to_its_papers_clip_and_aggregation():
    """GSPO averages over answers; CISPO's weight is bounded from above only (MiniMax-M1); set keys stay as set."""
    from hpc_rlhf.rl.config import clip_range, loss_aggregation

    def rl(*overrides):
        return load_config(grpo.Config, None, list(overrides)).rl

    assert [loss_aggregation(rl(f"rl.policy_loss={loss}")) for loss in ("ppo", "gspo", "cispo")] == [
        "token-mean", "seq-mean-token-mean", "token-mean"]
    assert loss_aggregation(rl("rl.policy_loss=gspo", "rl.loss_agg=token-mean")) == "token-mean"
    assert loss_aggregation(rl("rl.loss_agg=seq-mean-token-sum")) == "seq-mean-token-sum"
    assert clip_range(rl("rl.policy_loss=cispo")) == (1.0, 0.2)
    assert clip_range(rl("rl.policy_loss=cispo", "rl.clip_eps_high=0.28")) == (1.0, 0.28)
    assert clip_range(rl("rl.policy_loss=cispo", "rl.clip_eps=0.2")) == (0.2, None)  # as before: symmetric
    with pytest.raises(ConfigError, match="rl.policy_loss=gspo takes rl.loss_agg"):
        load_config(grpo.Config, None, ["rl.policy_loss=gspo", "rl.loss_agg=seq-mean-token-sum"])


# Each RLVR option on a one-rank GRPO run (the actor generating: rollout@actor), three runs covering them all.
RLVR_RUNS = {
    "dapo_gspo": ["rl.policy_loss=gspo", "rl.loss_agg=seq-mean-token-mean", "rl.dynamic_sampling=true",
                  "rl.dynamic_sampling_max_rounds=3", "rl.overlong_buffer=3", "rl.overlong_filter=true",
                  "rl.is_correction=tis_seq"],
    "cispo_mis_token": ["rl.policy_loss=cispo", "rl.clip_eps_high=0.28", "rl.is_correction=mis_token"],
    "ppo_mis_seq": ["rl.is_correction=mis_seq", "rl.is_high=1.5"],
}


@pytest.mark.parametrize("run", list(RLVR_RUNS))
def test_every_rlvr_option_runs_end_to_end_and_logs_its_figures(tmp_path, run):
    out = tmp_path / run
    hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={TINY_MODEL}",
                 "placement=actor+ref=1,rollout@actor", "rollout.prompts_per_step=4", "rollout.n_samples=4",
                 "rollout.max_new_tokens=4", "train.batch_size=16", "train.micro_batch_size=8", "train.max_steps=2",
                 "log.eval_every_steps=0", *RLVR_RUNS[run], *QUIET)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0 <= row["truncated_share"] <= 1
        if run != "dapo_gspo":
            assert 0 <= row["is_masked_share"] <= 1 and row["is_truncated_share"] == 0  # masking truncates nothing
        else:
            assert row["is_masked_share"] == 0 and 0 <= row["is_truncated_share"] <= 1
            # a random model's answers: every group differs or most do, so rounds run and the figures add up
            assert 1 <= row["generation_rounds"] <= 3 and 0 <= row["groups_filtered_share"] <= 1
            assert row["groups_unfilled"] >= 0 and row["extra_samples_per_trained"] >= 0
            # a random model runs into the 4-token limit: the overlong filter has something to drop
            assert row["truncated_share"] > 0


def test_k1_as_a_loss_term_is_refused_with_what_to_use_instead():
    with pytest.raises(ConfigError, match=r"rl.kl_estimator=k1 as a loss term .* zero expected gradient.*k2.*k3"):
        load_config(grpo.Config, None, ["rl.kl_estimator=k1"])
    load_config(grpo.Config, None, ["rl.kl_estimator=k1", "rl.kl_in_reward=true"])  # a penalty in the reward: fine


def test_an_unclipped_value_loss_can_be_chosen():
    assert load_config(ppo.Config, None, ["rl.value_clip_eps=null"]).rl.value_clip_eps is None


def test_actor_log_probs_at_the_sampling_temperature_equal_the_engines(tmp_path):
    """At T = 0.6 the engine samples from softmax(z / 0.6) and reports those log-probs; the actor's old log-probs
    must be the same quantity (computed at T = 1, as before, they gave a mean gap of 0.13 nats on this model).
    Hybrid placement: the engine generates with the actor's own weights, so the gap is rounding only."""
    out = tmp_path / "grpo"
    hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={TINY_MODEL}",
                 "placement=actor+ref=1,rollout@actor", "rollout.temperature=0.6", "rollout.prompts_per_step=4",
                 "rollout.n_samples=4", "train.batch_size=16", "train.micro_batch_size=8", "train.max_steps=2",
                 "rl.tis_cap=2.0", "log.eval_every_steps=0", *QUIET)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout_logprob_abs_diff"] < 1e-4 and row["rollout_logprob_abs_diff_max"] < 1e-3, row
        # figures apart and by name: the loss terms, the configured KL estimator (k3 for grpo) beside k1
        for key in ("policy_loss", "kl_loss", "entropy", "kl_k1", "kl_k3", "clip_fraction", "approx_kl",
                    "tis_weight"):
            assert key in row, key
        assert row["tis_weight"] == pytest.approx(1.0, abs=1e-3)  # pi_old = pi_rollout: weights of 1
        assert row["kl_k3"] >= 0


def test_a_batch_draws_its_prompts_once():
    """Rollout, exchange and scoring all ask for a batch's prompt rows; the permutation of the whole prompt set
    behind them is drawn once per batch (it is the same on every rank and after a resume: order.step_indices)."""
    from hpc_rlhf.data.order import step_indices
    from hpc_rlhf.rl.prompts import batch_rows

    batch_rows.cache_clear()
    for _ in range(3):
        assert batch_rows(1000, 16, 7, 3) == tuple(step_indices(1000, 16, 7, 3))
    assert batch_rows.cache_info().misses == 1 and batch_rows.cache_info().hits == 2


def test_old_logprobs_from_the_engine_or_the_first_forward_train_as_a_scoring_pass_does(tmp_path):
    """rl.old_logprobs (issue 37): on one rank whose hf engine is the actor, the engines' sampling log-probs and the
    first training forward's are the actor's scoring pass's up to the order of the sums, so a step's figures agree
    across the three sources; without the pass, no gap between engine and actor is logged."""
    rule = tmp_path / "digits.py"  # a reward the random model earns unevenly, so that the policy gets a gradient
    rule.write_text("def share(prompts, responses, answers):\n"
                    "    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]\n")
    common = ["--config", "examples/tiny/grpo.yaml", f"actor.path={TINY_ASSETS}/models/llama-tiny",
              f"reward.functions=[{rule}:share]",
              "placement=actor+ref=1,rollout@actor", "rollout.prompts_per_step=8", "rollout.n_samples=4",
              "train.batch_size=32", "train.micro_batch_size=16", "train.lr=1e-3", "train.max_steps=1",
              "log.eval_every_steps=0", "checkpoint.every_steps=0", *QUIET]
    figures = {}
    for source in ("recompute", "rollout", "first_forward"):
        out = tmp_path / source
        hpc_rlhf_cli("grpo", *common, f"output_dir={out}", f"rl.old_logprobs={source}")
        [figures[source]] = read_metrics(out)
    assert "rollout_logprob_abs_diff" in figures["recompute"]
    assert figures["recompute"]["rollout_logprob_abs_diff"] < 1e-4
    assert figures["recompute"]["actor_grad_norm"] > 0.1 and figures["recompute"]["reward_std"] > 0
    for source in ("rollout", "first_forward"):
        assert "rollout_logprob_abs_diff" not in figures[source]
        for key in ("reward", "policy_loss", "actor_grad_norm", "clip_fraction", "entropy", "kl_k3"):
            want = figures["recompute"][key]
            assert figures[source][key] == pytest.approx(want, rel=1e-3, abs=1e-6), (source, key)


@pytest.mark.parametrize("overrides, message", [
    (["rl.old_logprobs=rollout", "rl.is_correction=tis_token"], "leaves no old log-probs of the trainer's own"),
    (["rl.old_logprobs=first_forward"], "trained in 2 optimizer steps of train.batch_size=64"),
    (["rl.old_logprobs=first_forward", "train.batch_size=128", "rl.ppo_epochs=2"], "rl.ppo_epochs=2 passes"),
    (["rl.old_logprobs=first_forward", "train.batch_size=128", "rl.kl_in_reward=true"], "rl.kl_in_reward=true"),
])
def test_old_logprobs_sources_are_refused_where_they_would_train_something_else(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(grpo.Config, "examples/tiny/grpo.yaml", overrides)
    from hpc_rlhf.rl.config import is_correction

    rl = load_config(grpo.Config, "examples/tiny/grpo.yaml", ["rl.old_logprobs=rollout", "rl.max_staleness=1"]).rl
    assert is_correction(rl) == ("none", {})  # auto: nothing to correct with the engines' log-probs as the old ones


def test_padding_free_steps_train_as_padded_ones_on_fewer_tokens(tmp_path):
    """rl.padding_free (issue 37): a PPO run with every scoring role (actor, critic, ref and a reward model) on one
    rank trains on packed rows as on padded ones, up to float rounding (attention sums over rows of another width),
    and logs its pad share. Prompts of 2 to 31 characters, so that padded rows are far from full; rows of up to
    1024 tokens, so that each micro-batch is one row without a pad."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "+".join(["1"] * k) + "=", "answer": str(k)}) + "\n"
                               for k in range(1, 17)))
    common = ["--config", "examples/tiny/ppo.yaml", f"actor.path={TINY_MODEL}", f"critic.path={TINY_MODEL}",
              f"data.train_files=[{prompts}]",
              f"reward.models=[{TINY_MODEL}]", "placement=actor+critic+ref+reward=1,rollout@actor",
              "rollout.prompts_per_step=16", "rollout.n_samples=2", "rollout.max_new_tokens=8", "train.batch_size=32",
              "train.micro_batch_size=16", "critic_train.batch_size=32", "critic_train.micro_batch_size=16",
              "train.lr=1e-3", "train.max_steps=2", "log.eval_every_steps=0", "checkpoint.every_steps=0", *QUIET]
    figures = {}
    for name, padding_free in (("padded", "false"), ("packed", "true"), ("packed_again", "true")):
        out = tmp_path / name
        hpc_rlhf_cli("ppo", *common, f"output_dir={out}", f"rl.padding_free={padding_free}",
                     "rl.padding_free_row_tokens=1024")
        figures[name] = read_metrics(out)
    # A seeded packed run repeats bit for bit, wall-clock figures aside.
    def seeded(rows):
        return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]

    assert seeded(figures["packed"]) == seeded(figures["packed_again"])
    for padded, packed in zip(figures["padded"], figures["packed"], strict=True):
        assert padded["pad_share"] > 0.1 and packed["pad_share"] == 0, (padded["pad_share"], packed["pad_share"])
        for key in ("reward", "policy_loss", "value_loss", "actor_grad_norm", "critic_grad_norm", "entropy", "kl_k1",
                    "rollout_logprob_abs_diff"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-3, abs=1e-5), (key, padded, packed)


TWO_RANK_PLACEMENT = "actor+critic+ref+reward=2,rollout@actor"


def two_rank_args(prompts, out, *settings: str) -> list[str]:
    """A 2-rank PPO of three steps, actor under ZeRO-3 and critic under ZeRO-2 (DeepSpeed partitions them over the
    role's two ranks), on `prompts`; `settings` after the rest."""
    return ["--config", "examples/tiny/ppo.yaml", f"actor.path={TINY_MODEL}", f"critic.path={TINY_MODEL}",
            f"data.train_files=[{prompts}]", f"reward.models=[{TINY_MODEL}]", "rl.padding_free=true",
            "rollout.prompts_per_step=8", "rollout.n_samples=2", "rollout.max_new_tokens=8", "train.batch_size=16",
            "train.micro_batch_size=4", "critic_train.batch_size=16", "critic_train.micro_batch_size=4",
            "train.lr=1e-3", "train.max_steps=3", "log.eval_every_steps=0", "checkpoint.every_steps=0",
            "train.zero_stage=3", "critic_train.zero_stage=2", *QUIET, f"output_dir={out}",
            f"placement={TWO_RANK_PLACEMENT}", *settings]


def two_rank_ppo(prompts, out, *settings: str) -> list[dict]:
    """The metrics of `two_rank_args`' run."""
    hpc_rlhf_cli("ppo", *two_rank_args(prompts, out, *settings))
    return read_metrics(out)


@pytest.fixture(scope="module")
def two_rank_baseline(tmp_path_factory):
    """(prompts, metrics) of the 2-rank PPO as configured: micro-batches of 4 samples, the two ranks data-parallel;
    what the micro-batches by tokens and the sequence-parallel run must train as."""
    folder = tmp_path_factory.mktemp("two_rank_ppo")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "+".join(["1"] * k) + "=", "answer": str(k)}) + "\n"
                               for k in range(1, 17)))
    return prompts, two_rank_ppo(prompts, folder / "data_parallel")


TRAINED_ALIKE = ("reward", "policy_loss", "value_loss", "actor_grad_norm", "critic_grad_norm", "entropy", "kl_k1",
                 "rollout_logprob_abs_diff")


def test_micro_batches_by_tokens_train_as_micro_batches_by_samples(tmp_path, two_rank_baseline):
    """rl.micro_batch_tokens (issue 37): the 2-rank PPO whose actor (ZeRO-3) and critic (ZeRO-2) train, and whose
    four roles score, in micro-batches of at most 40 tokens trains as the same run in micro-batches of 4 samples, up
    to float rounding: the loss of an optimizer step is a mean over its tokens whatever its micro-batches. Prompts
    of 1 to 16 terms, so that each rank's share needs another number of micro-batches from step to step and from
    the other rank's (both run the larger number: ZeRO-3 gathers parameters collectively in each pass); scoring by
    a budget of its own (rl.score_micro_batch_tokens)."""
    prompts, by_samples = two_rank_baseline
    by_tokens = two_rank_ppo(prompts, tmp_path / "by_tokens", "rl.micro_batch_tokens=40",
                             "rl.score_micro_batch_tokens=70")
    assert len(by_tokens) == 3
    for samples, tokens in zip(by_samples, by_tokens, strict=True):
        assert samples["actor_micro_batches"] == 2  # 8 samples a rank, 4 at a time
        assert tokens["actor_micro_batches"] > 2, tokens["actor_micro_batches"]
        assert tokens["response_length"] == samples["response_length"]
        for key in TRAINED_ALIKE:
            assert tokens[key] == pytest.approx(samples[key], rel=1e-3, abs=1e-5), (key, samples, tokens)


def test_sequence_parallel_roles_train_as_data_parallel_ones(tmp_path, two_rank_baseline):
    """Sequence parallelism (issue 40): the 2-rank PPO whose actor, critic, ref and reward model each share every
    packed row between their two ranks (`<kind>_sp=2`) trains as the same run with the two ranks data-parallel, up
    to float rounding: the same samples (the hybrid engines generate the same), rewards, losses, KL and gradient
    norms, over three steps, with the actor under ZeRO-3 and the critic under ZeRO-2 (DeepSpeed partitions them
    over the role's two ranks, which are also the one sequence block that exchanges activations). And
    without packed rows it is refused at configuration, naming the keys."""
    prompts, plain_run = two_rank_baseline
    sharded = f"{TWO_RANK_PLACEMENT},actor_sp=2,critic_sp=2,ref_sp=2,reward_sp=2"
    shared_run = two_rank_ppo(prompts, tmp_path / "sequence_parallel", f"placement={sharded}")
    assert len(shared_run) == 3
    for plain, shared in zip(plain_run, shared_run, strict=True):
        assert shared["response_length"] == plain["response_length"]
        for key in TRAINED_ALIKE:
            assert shared[key] == pytest.approx(plain[key], rel=1e-3, abs=1e-5), (key, plain, shared)
    refused = hpc_rlhf_cli("ppo", *two_rank_args(prompts, tmp_path / "padded", f"placement={sharded}",
                                                 "rl.padding_free=false"), check=False)
    assert refused.returncode != 0
    assert "actor_sp=2, critic_sp=2, ref_sp=2, reward_sp=2: sequence parallelism splits packed rows" in \
        refused.stdout + refused.stderr


def test_a_reward_model_of_another_tokenizer_is_refused_at_set_up(tmp_path):
    """A reward model scores the policy's token ids: one whose tokenizer maps tokens to other ids is refused by
    name on its ranks' set-up, before a sample is generated (and by the sbatch scripts' preflight)."""
    import shutil

    other = tmp_path / "rm"
    shutil.copytree(TINY_MODEL, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    proc = hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"actor.path={TINY_MODEL}", "rl.kl_coef=0",
                        "placement=actor=1,reward=1,rollout@actor", f"reward.models=[{other}]", "reward.functions=[]",
                        f"output_dir={tmp_path / 'out'}", *QUIET, check=False)
    assert proc.returncode != 0
    assert (f"reward.models[0] '{other}' does not share the tokenizer of actor.path '{TINY_MODEL}': 104 vs 104 "
            f"tokens, 2 mapped differently") in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_actor_of_the_best_evaluation_is_kept(tmp_path):
    """checkpoint.best_metric=eval_accuracy in GRPO on three ranks (the actor on two, an engine on the third): after
    each evaluation of a trained step, the actor of the best one so far is written to output_dir/best/ with its
    record (rank 0's figures, every rank following; the engine's rank holds no model to write)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "grpo"
    hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={TINY_MODEL}",
                 "placement=actor=2,rollout=1", "rl.kl_coef=0", "rollout.prompts_per_step=4", "rollout.n_samples=4",
                 "train.batch_size=16", "train.micro_batch_size=8", "train.lr=1e-3", "train.max_steps=2",
                 "log.eval_every_steps=1",
                 "eval.max_rows=16", "checkpoint.best_metric=eval_accuracy", *QUIET)
    evals = {r["step"]: r["eval_accuracy"] for r in read_metrics(out) if "eval_accuracy" in r and r["step"] > 0}
    assert sorted(evals) == [1, 2]
    first_best = max(evals, key=lambda step: (evals[step], -step))  # a later tie does not replace it
    record = json.loads((out / "best" / "best.json").read_text())
    assert record == {"metric": "eval_accuracy", "value": evals[first_best], "step": first_best}
    AutoModelForCausalLM.from_pretrained(out / "best")
    assert (out / "best" / "tokenizer.json").is_file()
