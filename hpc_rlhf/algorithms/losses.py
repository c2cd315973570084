"""Training losses of every mode: SFT, reward model, DPO/cDPO/IPO, KTO, and RL's policy losses (PPO's clipped
token surrogate, GSPO's sequence-level one, CISPO's clipped-weight policy gradient) and PPO's value loss.

Each is a pure function of tensors. Inputs that are targets or come from a frozen model (reference log-probs,
old log-probs, advantages, returns) are detached here, so a caller cannot leak gradients into them by mistake.
Per-sequence log-probs come from `logprobs.sequence_logprob`; per-token tensors are (batch, seq) with a mask
(see `logprobs` for the conventions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_rlhf.algorithms.choices import DPO_LOSS_TYPES, GSPO_CLIP_EPS, GSPO_CLIP_EPS_HIGH, GSPO_LOSS_AGGREGATIONS
from hpc_rlhf.algorithms.kl import kl_estimate
from hpc_rlhf.algorithms.logprobs import _check_shapes, masked_mean, masked_sum, token_logprobs

# |log pi/pi_old| beyond this is clamped in the policy loss: exp(20) = 4.9e8 is finite in fp32 and bf16, and any
# ratio that far from 1 is clipped away anyway.
LOG_RATIO_LIMIT = 20.0
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


# ------------------------------------------------------------------------------------------------------- SFT
def sft_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Negative log-likelihood of the label tokens, averaged over the tokens that are not `ignore_index`.

    logits (batch, seq, vocab) already aligned with labels (batch, seq): logits[:, t] predicts labels[:, t].
    Prompt-only training is the caller's choice of labels: set every token that is not to be learnt (prompt,
    padding, user and system turns of a multi-turn chat) to `ignore_index`. A batch with no label is 0.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits shape {tuple(logits.shape)} "
                         f"without its vocabulary dim")
    learnt = labels != ignore_index
    logps = token_logprobs(logits, labels.masked_fill(~learnt, 0))
    return -masked_mean(logps, learnt)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
    """Knowledge distillation on given text (Hinton et al. 2015): at every label token the cross-entropy of the
    student's next-token distribution against the teacher's,

        loss = mean_t  -sum_v p_teacher(v | x_<t) log p_student(v | x_<t),

    averaged over the tokens that are not `ignore_index`. It is the forward KL(teacher || student) plus the
    teacher's entropy, which does not depend on the student. Both logits (batch, seq, vocab) are aligned with
    labels (batch, seq) as in `sft_loss`; the labels only say which positions count. A batch with no label is 0.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two models must share the vocabulary")
    if labels.shape != student_logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits shape "
                         f"{tuple(student_logits.shape)} without its vocabulary dim")
    learnt = labels != ignore_index
    if not learnt.any():
        return student_logits.nan_to_num(0.0, 0.0, 0.0).sum() * 0.0  # no label token: 0, still in the graph
    # Only the label positions: the (tokens, vocab) probabilities of the prompt would be memory spent for nothing.
    teacher_probs = torch.softmax(teacher_logits[learnt].float(), dim=-1)
    student_logps = torch.log_softmax(student_logits[learnt].float(), dim=-1)
    # A token the student rules out entirely (-inf) that the teacher also gives no mass would make 0 * -inf = nan.
    return -(teacher_probs * student_logps.masked_fill(teacher_probs == 0, 0.0)).sum(dim=-1).mean()


# ------------------------------------------------------------------------------------------------ reward model
def pairwise_reward_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                         margin: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry loss of a reward model on preference pairs (Ouyang et al. 2022, InstructGPT):

        loss = mean_i -log sigmoid(r_chosen_i - r_rejected_i - m_i)

    with an optional margin m (Touvron et al. 2023, Llama 2: a larger margin for pairs the annotators found
    clearly different). chosen_scores, rejected_scores: (batch,). Returns (loss, accuracy), accuracy being the
    share of pairs with r_chosen > r_rejected (a tie counts as wrong).
    """
    _check_shapes(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    difference = chosen_scores - rejected_scores
    if margin is not None:
        difference = difference - margin
    loss = -F.logsigmoid(difference).mean()
    accuracy = (chosen_scores > rejected_scores).float().mean().detach()
    return loss, accuracy


def process_reward_loss(marker_logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of a process reward model (Lightman et al. 2023; Wang et al. 2024, Math-Shepherd): at the marker
    that ends each step of a solution, the model's next-token distribution over the K reward tokens ("+", "-")
    is fit to the step's label by cross-entropy:

        loss = mean_n -sum_k q_nk log softmax(z_n)_k

    marker_logits z: (N, K), the logits of the reward tokens at the N markers; targets q: (N, K), each row a
    probability vector (one-hot for a hard label). Returns (loss, accuracy), accuracy being the share of markers
    whose most likely reward token is the label's (the first one on a tie).
    """
    _check_shapes(marker_logits=marker_logits, targets=targets)
    loss = -(targets * F.log_softmax(marker_logits.float(), dim=-1)).sum(-1).mean()
    accuracy = (marker_logits.argmax(-1) == targets.argmax(-1)).float().mean().detach()
    return loss, accuracy


# ----------------------------------------------------------------------------------------------------- DPO
def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference losses on sequence log-probs (batch,) of the policy and of the frozen reference.

    With h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)):
    - "sigmoid", DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
      Reward Model"): loss = -log sigmoid(beta * h), the Bradley-Terry likelihood of the implicit reward
      beta * log(pi / ref).
      With label_smoothing eps > 0 it is cDPO (Mitchell 2023, "A note on DPO with noisy preferences"): each
      label is taken to be flipped with probability eps,
      loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    - "ipo", IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
      Preferences"): loss = (h - 1 / (2 beta))^2, a regression of h onto a fixed target that, unlike DPO, does
      not keep pushing h up once the preference is satisfied. The log-probs for IPO are expected to be
      length-averaged (`sequence_logprob(..., average=True)`), as the target 1/(2 beta) is per token in scale.
    Returns (mean loss, chosen_rewards, rejected_rewards), the rewards being beta * log(pi / ref) per sequence
    (detached; their difference is what the loss sees).
    """
    _check_shapes(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                  ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_log_ratio = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_log_ratio = policy_rejected_logps - ref_rejected_logps.detach()
    h = chosen_log_ratio - rejected_log_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing (cDPO) applies to loss_type='sigmoid' only, not 'ipo'")
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    return losses.mean(), beta * chosen_log_ratio.detach(), beta * rejected_log_ratio.detach()


# ----------------------------------------------------------------------------------------------------- KTO
def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels_desirable: torch.Tensor,
             kl_reference: torch.Tensor | float, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"), for answers
    labelled only good or bad, without pairs.

    With r = log pi(y|x) - log ref(y|x) and the reference point z0:
        value = lambda_D * sigmoid(beta (r - z0))       desirable y
                lambda_U * sigmoid(beta (z0 - r))       undesirable y
        loss  = mean (lambda_y - value)
    z0 = max(0, KL(pi || ref)) is passed in as `kl_reference`: the caller estimates it from mismatched pairs
    (answer of one prompt scored under another prompt, mean of r over the batch, averaged across ranks).
    It is detached and clamped at 0 here: the paper uses it as a baseline, not something to optimise.
    The paper suggests weights with lambda_D * n_D / (lambda_U * n_U) in [1, 4/3] for n_D desirable and n_U
    undesirable examples. policy_logps, ref_logps, labels_desirable (bool): (batch,).
    Returns (loss, rewards) with rewards = beta * r per example (detached).
    """
    _check_shapes(policy_logps=policy_logps, ref_logps=ref_logps, labels_desirable=labels_desirable)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"desirable_weight and undesirable_weight must be >= 0, "
                         f"got {desirable_weight} and {undesirable_weight}")
    log_ratio = policy_logps - ref_logps.detach()
    z0 = torch.as_tensor(kl_reference, dtype=log_ratio.dtype, device=log_ratio.device).detach().clamp(min=0)
    desirable = labels_desirable.bool()
    value = torch.where(desirable, desirable_weight * torch.sigmoid(beta * (log_ratio - z0)),
                        undesirable_weight * torch.sigmoid(beta * (z0 - log_ratio)))
    weight = torch.where(desirable, desirable_weight, undesirable_weight).to(value.dtype)
    return (weight - value).mean(), beta * log_ratio.detach()


# ----------------------------------------------------------------------------------------------------- PPO
def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token-mean",
                   normalizer: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss (batch, seq) to a scalar.

    token-mean           sum over all response tokens / their number: every token weighs the same
                         (DAPO, Yu et al. 2025); long answers weigh more.
    seq-mean-token-sum   per-sequence sum, averaged over sequences: no per-length normalisation, as in
                         Dr. GRPO (Liu et al. 2025), up to its constant divisor.
    seq-mean-token-mean  per-sequence mean, averaged over sequences (the original GRPO): every answer weighs the
                         same, so each token of a short answer weighs more.
    Sequences without any response token are left out of the sequence means.

    `normalizer` replaces the count this batch would divide by (its tokens for token-mean, its sequences with a
    response otherwise) with the count of the whole optimizer step: a micro-batch then contributes its sum /
    that count, so the micro-batches of one step add up to the true mean over the step, whatever their lengths.
    """
    if loss_agg == "token-mean":
        if normalizer is not None:
            return masked_sum(token_loss, mask) / max(float(normalizer), 1.0)
        return masked_mean(token_loss, mask)
    if loss_agg == "seq-mean-token-sum":
        per_sequence = masked_sum(token_loss, mask, dim=-1)
    elif loss_agg == "seq-mean-token-mean":
        per_sequence = masked_mean(token_loss, mask, dim=-1)
    else:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGREGATIONS)}, got {loss_agg!r}")
    has_response = (mask != 0).any(-1)
    if normalizer is not None:
        return masked_sum(per_sequence, has_response) / max(float(normalizer), 1.0)
    return masked_mean(per_sequence, has_response)


def loss_normalizer(mask: torch.Tensor, loss_agg: str) -> float:
    """What `aggregate_loss` divides by for this mask: response tokens (token-mean) or sequences with a response."""
    if loss_agg == "token-mean":
        return float((mask != 0).sum())
    return float((mask != 0).any(-1).sum())


def loss_mask(action_mask: torch.Tensor, keep_tokens: torch.Tensor | None = None,
              keep_sequences: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens a policy loss trains on: the response tokens of `action_mask` (batch, seq) that `keep_tokens`
    (batch, seq) and `keep_sequences` (batch,) both keep (bool, or 0/1; None keeps everything). Returns bool.

    Masked importance sampling (`importance.off_policy_correction`, mis_token and mis_seq) and DAPO's overlong
    filter (`overlong.truncated_responses`) drop tokens or whole answers this way. A dropped token leaves the
    mean, not only its numerator: pass this mask as the loss's `mask` AND compute the step's `loss_normalizer`
    from it. Keeping dropped tokens in the denominator would shrink every step's update by the share dropped,
    a learning-rate change that follows the engine mismatch or the share of cut answers from step to step; both
    DAPO (Yu et al. 2025) and masked IS define the loss as the mean over the tokens kept. A sequence with no
    token left counts in no sequence mean (see `aggregate_loss`).
    """
    kept = action_mask != 0
    if keep_tokens is not None:
        _check_shapes(action_mask=action_mask, keep_tokens=keep_tokens)
        kept = kept & (keep_tokens != 0)
    if keep_sequences is not None:
        if keep_sequences.shape != action_mask.shape[:1]:
            raise ValueError(f"keep_sequences must be (batch,) = ({action_mask.shape[0]},) for action_mask "
                             f"{tuple(action_mask.shape)}, got {tuple(keep_sequences.shape)}")
        kept = kept & (keep_sequences != 0).unsqueeze(-1)
    return kept


def _check_clip(clip_eps: float, clip_eps_high: float | None) -> None:
    if clip_eps <= 0 or (clip_eps_high is not None and clip_eps_high <= 0):
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps} and {clip_eps_high}")


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float = 0.2, clip_eps_high: float | None = None, dual_clip: float | None = None,
                loss_agg: str = "token-mean", normalizer: float | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"), per token:

        rho  = pi(y_t) / pi_old(y_t)
        loss = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)

    eps_high = clip_eps_high, or clip_eps when None; a larger upper bound is DAPO's "clip-higher" (Yu et al.
    2025), which lets rare tokens with A > 0 grow faster. dual_clip c > 1 (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep Reinforcement Learning") also bounds the loss by -c A where A < 0, so a
    huge ratio on a bad token cannot blow up the update. logps (batch, seq) carry the gradient; old_logps and
    advantages are constants. Returns (loss, clip_fraction, approx_kl): the share of response tokens whose
    gradient clipping removed, and the k3 estimate of KL(pi_old || pi) over the response tokens.

    log rho is clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] before exp: exp(100) overflows fp32, and the
    inf it makes turns into NaN gradients even where clipping would have discarded the token. `token_weights`
    (constants, e.g. truncated importance weights pi_old / pi_rollout) multiply each token's loss;
    `normalizer` is passed to `aggregate_loss`.
    """
    _check_shapes(logps=logps, old_logps=old_logps, advantages=advantages, mask=mask)
    _check_clip(clip_eps, clip_eps_high)
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss at dual_clip * |A|), got {dual_clip}")
    valid = mask != 0
    # Zero the padding before exp: an inf there, masked out of the loss, would still make 0 * inf = NaN in backward.
    log_ratio = (logps - old_logps.detach()).masked_fill(~valid, 0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    advantages = advantages.detach().masked_fill(~valid, 0)
    ratio = torch.exp(log_ratio)
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_high) * advantages
    token_loss = -torch.min(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip is not None:
        dual_bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (token_loss > dual_bound)
        token_loss = torch.where(dual_active, dual_bound, token_loss)
        was_clipped = was_clipped | dual_active
    if token_weights is not None:
        _check_shapes(logps=logps, token_weights=token_weights)
        token_loss = token_loss * token_weights.detach().masked_fill(~valid, 0)
    loss = aggregate_loss(token_loss, mask, loss_agg, normalizer)
    with torch.no_grad():
        clip_fraction = masked_mean(was_clipped.to(log_ratio.dtype), mask)
        # Tokens were sampled from pi_old, so KL(pi_old || pi) is the direction k3 estimates without bias.
        approx_kl = masked_mean(kl_estimate(old_logps, logps.detach(), "k3"), mask)
    return loss, clip_fraction, approx_kl


def gspo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float = GSPO_CLIP_EPS, clip_eps_high: float | None = GSPO_CLIP_EPS_HIGH,
              loss_agg: str = "seq-mean-token-mean", normalizer: float | None = None,
              token_weights: torch.Tensor | None = None, token_level: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clipped surrogate on one importance
    ratio per answer, the geometric mean of its token ratios over its |y_i| response tokens:

        s_i    = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(1/|y_i| sum_t log(pi(y_i,t) / pi_old(y_i,t)))
        loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
        loss   = 1/G sum_i loss_i                                          (G answers)

    One clipping decision per answer: a clipped answer gives none of its tokens a gradient; an unclipped one gives
    each token -A_i s_i / |y_i| times its log-prob gradient, however far that token's own ratio moved. Because
    s_i is a mean in log space it stays near 1, hence the paper's narrow default range (3e-4, 4e-4).

    token_level=True is GSPO-token: s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], the same value as s_i with the
    gradient of each token's own log-prob only, so per-token advantages A_i,t can differ within an answer
    (with A_i,t = A_i the gradient is GSPO's). Without it, advantages that differ within an answer each enter
    -min(s_i A_i,t, clip(s_i) A_i,t), whose gradient reaches every token of the answer through s_i.

    loss_agg: "seq-mean-token-mean" (default) is the paper's mean over answers (every token of answer i holds
    loss_i, so its token mean is loss_i). "token-mean" weighs each answer's loss by its length, the token mean
    of GSPO-token's per-token terms (DAPO's token-level weighting). "seq-mean-token-sum" is refused: it multiplies
    each answer's length-normalised loss by its length again, so the sequence-level clip range would bound
    updates whose size grows with the answer. `normalizer` has `aggregate_loss`'s meaning (answers with a
    response token, or tokens, of the whole optimizer step: `loss_normalizer(step_mask, loss_agg)`).
    `token_weights` (constants) multiply each token's loss; for a sequence-level weight give the same weight to
    every token of the answer (what `importance.off_policy_correction` returns for tis_seq and mis_seq).
    The mean inside s_i runs over `mask`: with masked IS or the overlong filter pass `loss_mask(...)` here.

    Returns (loss, clip_fraction, approx_kl) as `policy_loss`: clip_fraction is the share of response tokens whose
    gradient clipping removed (whole answers here, the quantity the paper compares with GRPO's), approx_kl the k3
    estimate of KL(pi_old || pi) per token. log s_i is clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT].
    """
    _check_shapes(logps=logps, old_logps=old_logps, advantages=advantages, mask=mask)
    _check_clip(clip_eps, clip_eps_high)
    if loss_agg == "seq-mean-token-sum":
        raise ValueError("GSPO takes loss_agg seq-mean-token-mean (the paper's mean over answers) or token-mean, not "
                         "seq-mean-token-sum: a sum over tokens multiplies each answer's length-normalised loss by its "
                         "length again")
    if loss_agg not in GSPO_LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg must be one of {', '.join(GSPO_LOSS_AGGREGATIONS)} for GSPO, got {loss_agg!r}")
    valid = mask != 0
    token_log_ratio = (logps - old_logps.detach()).masked_fill(~valid, 0)
    # The mean first, then the clamp: clamping each token would change s_i, not only guard the exp.
    sequence_log_ratio = masked_mean(token_log_ratio, mask, dim=-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if token_level:
        own = logps.masked_fill(~valid, 0)  # padding may hold inf or NaN: keep it out of own - sg[own]
        log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + (own - own.detach())
    else:
        log_ratio = sequence_log_ratio.unsqueeze(-1).expand_as(logps)
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach().masked_fill(~valid, 0)
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_high) * advantages
    token_loss = -torch.min(unclipped, clipped)
    if token_weights is not None:
        _check_shapes(logps=logps, token_weights=token_weights)
        token_loss = token_loss * token_weights.detach().masked_fill(~valid, 0)
    loss = aggregate_loss(token_loss, mask, loss_agg, normalizer)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped < unclipped).to(ratio.dtype), mask)
        approx_kl = masked_mean(kl_estimate(old_logps, logps.detach(), "k3"), mask)
    return loss, clip_fraction, approx_kl


def cispo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_eps: float = 0.2, clip_eps_high: float | None = None, loss_agg: str = "token-mean",
               normalizer: float | None = None, token_weights: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"): clip the
    importance weight, not the update, per token:

        r_t    = pi(y_t) / pi_old(y_t)
        loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi(y_t)

    sg = stop-gradient. Every token keeps a gradient, -clip(r_t) A_t times that of its log-prob: a token that PPO's
    clip would silence (often a rare "fork" token whose ratio moved most) is only down- or up-weighted. The paper
    normalises by the batch's response tokens (loss_agg="token-mean", the default); the other aggregations of
    `aggregate_loss` apply as for `policy_loss`, and `normalizer` likewise. eps_high = clip_eps_high, or clip_eps
    when None; clip_eps >= 1 removes the lower bound (r_t > 0), which is how the paper runs it (upper bound only).
    `token_weights` (constants, e.g. importance weights pi_old / pi_rollout) multiply each token's loss.

    The loss's value contains log pi, so it is not comparable with PPO's surrogate: only its gradient is the
    objective's. Returns (loss, clip_fraction, approx_kl): clip_fraction here is the share of response tokens whose
    weight the clip changed (no gradient is removed), approx_kl the k3 estimate of KL(pi_old || pi).
    """
    _check_shapes(logps=logps, old_logps=old_logps, advantages=advantages, mask=mask)
    _check_clip(clip_eps, clip_eps_high)
    valid = mask != 0
    log_ratio = (logps.detach() - old_logps.detach()).masked_fill(~valid, 0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    weight = ratio.clamp(1 - clip_eps, 1 + clip_high)
    advantages = advantages.detach().masked_fill(~valid, 0)
    token_loss = -weight * advantages * logps.masked_fill(~valid, 0)
    if token_weights is not None:
        _check_shapes(logps=logps, token_weights=token_weights)
        token_loss = token_loss * token_weights.detach().masked_fill(~valid, 0)
    loss = aggregate_loss(token_loss, mask, loss_agg, normalizer)
    with torch.no_grad():
        clip_fraction = masked_mean((weight != ratio).to(ratio.dtype), mask)
        approx_kl = masked_mean(kl_estimate(old_logps, logps.detach(), "k3"), mask)
    return loss, clip_fraction, approx_kl


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float | None = 0.2, normalizer: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (as in OpenAI's baselines PPO2), mean over response tokens:

        V_clip = V_old + clip(V - V_old, -eps, eps)
        loss   = 1/2 * mean max((V - R)^2, (V_clip - R)^2)

    The max makes it pessimistic: a value that moved more than eps from V_old gets no credit for moving
    towards R. clip_eps=None gives the plain 1/2 (V - R)^2. values, old_values, returns, mask: (batch, seq).
    Returns (loss, clip_fraction), the share of tokens where the clipped term won. `normalizer`: the response
    tokens of the whole optimizer step (see `aggregate_loss`), so that micro-batches add up to its token mean.
    """
    _check_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
    valid = mask != 0
    # Zero padding first: NaN there would reach the gradient through the square.
    values = values.masked_fill(~valid, 0)
    old_values = old_values.detach().masked_fill(~valid, 0)
    returns = returns.detach().masked_fill(~valid, 0)
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return (0.5 * aggregate_loss(unclipped, mask, "token-mean", normalizer),
                torch.zeros((), dtype=unclipped.dtype, device=values.device))
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0 or None, got {clip_eps}")
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.max(unclipped, clipped), mask, "token-mean", normalizer)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).to(unclipped.dtype), mask)
    return loss, clip_fraction
