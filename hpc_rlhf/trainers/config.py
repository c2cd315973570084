"""The configuration of the one-model modes (`sft`, `kd`, `rm`, `prm`, `dpo`, `kto`, `generate`, `rs`, `csft`,
`idpo`): each
mode's `Config` with the sections and defaults of its own, beside the shared ones of hpc_rlhf/config.py. It imports
no torch: `--help` and `--dry-run` read these keys on a login node or in a Slurm batch step, before any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpc_rlhf.algorithms.choices import DPO_LOSS_TYPES, STEP_AGGREGATIONS
from hpc_rlhf.config import (TINY_ASSETS, CheckpointSection, ConfigError, DataSection, DistSection, LogSection,
                             ModelSection, ReferenceSection, TrainSection, field, section)

STRATEGIES = ("best", "top_k", "threshold")  # rejection sampling's selections (rejection.select_samples)


# ------------------------------------------------------------------------------------------------------- sft
@dataclass
class GenerationEvalSection:
    """Held-out accuracy by greedy generation (rows with a prompt and a reference answer)."""
    prompt_files: list[str] = field([f"{TINY_ASSETS}/data/prompts_eval.jsonl"],
                                    help="rows with data.prompt_key and data.answer_key ([] = off)")
    max_rows: int = field(200, min=1, help="evaluate on at most this many prompts")
    max_new_tokens: int = field(8, min=1)


def _sft_data() -> DataSection:
    return DataSection(train_files=[f"{TINY_ASSETS}/data/sft_train.jsonl"],
                       eval_files=[f"{TINY_ASSETS}/data/sft_eval.jsonl"])


@dataclass
class SFTConfig:
    output_dir: str = field("runs/sft", help="where metrics, TensorBoard, checkpoints and final/ go")
    model: ModelSection = section(ModelSection)
    data: DataSection = dataclasses.field(default_factory=_sft_data)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)


def refuse_packing(data: DataSection, mode: str) -> None:
    """data.packing is SFT's (and what trains through it); the other one-model modes train padded rows, and a key
    they would ignore is refused rather than dropped."""
    if data.packing:
        raise ConfigError(f"data.packing: {mode} trains padded rows (packing is for sft, csft and rs): remove it")


# -------------------------------------------------------------------------------------------------------- kd
@dataclass
class DistillationSection:
    """Knowledge distillation on the training texts: a frozen teacher's next-token distribution at every response
    token, beside the data's own tokens (algorithms.losses.distillation_loss)."""
    teacher: str = field("runs/grpo/final", help="teacher model folder: a causal LM with the student's tokenizer")
    coef: float = field(0.4, min=0, max=1, help="weight of the distillation loss; the next-token loss of the data "
                                                "weighs 1 - coef (1: the teacher alone)")


@dataclass
class KDConfig:
    output_dir: str = field("runs/kd", help="where metrics, TensorBoard, checkpoints and final/ go")
    model: ModelSection = section(ModelSection)
    kd: DistillationSection = section(DistillationSection)
    data: DataSection = dataclasses.field(default_factory=_sft_data)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)


# -------------------------------------------------------------------------------------------------------- rm
@dataclass
class PreferenceDataSection(DataSection):
    """Preference pairs: prompt, chosen and rejected responses."""
    train_files: list[str] = field([f"{TINY_ASSETS}/data/pref_train.jsonl"], help="training data files or folders")
    eval_files: list[str] = field([f"{TINY_ASSETS}/data/pref_eval.jsonl"], help="held-out data files or folders")


@dataclass
class RewardSection:
    """The reward-model loss."""
    margin_key: str | None = field(None, help="column with a per-pair margin subtracted inside the loss "
                                              "(Llama 2); none = no margin")
    share_prompt: bool = field(False, help="score a pair in one row holding its prompt once (a 4D attention mask "
                                           "hides the chosen response from the rejected one): fewer tokens when "
                                           "prompts are long; sdpa or eager attention")

    def validate(self) -> None:
        if self.margin_key is not None and not self.margin_key.strip():
            raise ConfigError("rm.margin_key is empty; give a column name, or null for no margin")


@dataclass
class RMConfig:
    output_dir: str = field("runs/rm", help="where metrics, TensorBoard, checkpoints and final/ go")
    model: ModelSection = section(ModelSection)
    rm: RewardSection = section(RewardSection)
    data: PreferenceDataSection = section(PreferenceDataSection)
    train: TrainSection = section(TrainSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)

    def validate(self) -> None:
        refuse_packing(self.data, "rm")
        if self.rm.share_prompt and self.model.attn_implementation == "flash_attention_2":
            raise ConfigError("rm.share_prompt=true needs a 4D attention mask, which "
                              "model.attn_implementation=flash_attention_2 does not take: use sdpa or eager, or "
                              "rm.share_prompt=false")


# ------------------------------------------------------------------------------------------------------- prm
@dataclass
class ProcessDataSection(DataSection):
    """Worked solutions with a marker token after each step, and one label per step."""
    train_files: list[str] = field([f"{TINY_ASSETS}/data/prm_train.jsonl"], help="training data files or folders")
    eval_files: list[str] = field([f"{TINY_ASSETS}/data/prm_eval.jsonl"], help="held-out data files or folders")
    input_key: str = field("input", help="column with the solution text, a marker after each step")
    label_key: str = field("label", help="column with the list of step labels: reward tokens, or numbers in "
                                         "[0, 1] (the first reward token's probability)")


@dataclass
class ProcessRewardSection:
    """What a process reward model reads and predicts."""
    placeholder_token: str = field("#", help="the marker after each step, one token (Math-Shepherd's data: 'ки')")
    reward_tokens: list[str] = field(["+", "-"], help="the tokens the model predicts at a marker, the right-step "
                                                      "token first; one token each")

    def validate(self) -> None:
        if len(self.reward_tokens) < 2 or len(set(self.reward_tokens)) != len(self.reward_tokens):
            raise ConfigError(f"prm.reward_tokens needs at least two different tokens, got {self.reward_tokens}")
        if self.placeholder_token in self.reward_tokens:
            raise ConfigError(f"prm.placeholder_token {self.placeholder_token!r} is also one of prm.reward_tokens")


@dataclass
class PRMConfig:
    output_dir: str = field("runs/prm", help="where metrics, TensorBoard, checkpoints and final/ go")
    model: ModelSection = section(ModelSection)
    prm: ProcessRewardSection = section(ProcessRewardSection)
    data: ProcessDataSection = section(ProcessDataSection)
    train: TrainSection = section(TrainSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)

    def validate(self) -> None:
        refuse_packing(self.data, "prm")


# ------------------------------------------------------------------------------------------------------- dpo
@dataclass
class DPOSection:
    """The direct preference loss."""
    loss_type: str = field("sigmoid", choices=DPO_LOSS_TYPES, help="sigmoid = DPO (cDPO with label_smoothing); "
                                                                   "ipo = IPO on length-averaged log-probs")
    beta: float = field(0.1, min=1e-9, help="strength of the pull towards the reference")
    label_smoothing: float = field(0.0, min=0, max=0.5, help="cDPO: assumed share of flipped labels, in [0, 0.5)")
    sft_weight: float = field(0.0, min=0, help="add this multiple of the chosen responses' NLL to the loss")

    def validate(self) -> None:
        if self.label_smoothing >= 0.5:
            raise ConfigError(f"dpo.label_smoothing must be below 0.5 (at 0.5 the labels carry no information), "
                              f"got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError(f"dpo.label_smoothing (cDPO) applies to dpo.loss_type=sigmoid only, not "
                              f"{self.loss_type}")


def check_grouping_with_nll(train: TrainSection, dpo: DPOSection) -> None:
    """train.group_by_length keeps DPO's loss (a mean over the step's pairs) but not its NLL term, which is a mean
    over each micro-batch's chosen tokens: sorted micro-batches would weigh short answers' tokens more."""
    if train.group_by_length and dpo.sft_weight:
        raise ConfigError(f"train.group_by_length with dpo.sft_weight={dpo.sft_weight}: the NLL term is a mean over "
                          "each micro-batch's chosen tokens, so micro-batches sorted by length would change it; "
                          "set dpo.sft_weight=0 or train.group_by_length=false")


@dataclass
class DPOConfig:
    output_dir: str = field("runs/dpo", help="where metrics, TensorBoard, checkpoints and final/ go")
    model: ModelSection = section(ModelSection)
    ref: ReferenceSection = section(ReferenceSection)
    dpo: DPOSection = section(DPOSection)
    data: PreferenceDataSection = section(PreferenceDataSection)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)

    def validate(self) -> None:
        refuse_packing(self.data, "dpo")
        check_grouping_with_nll(self.train, self.dpo)


# ------------------------------------------------------------------------------------------------------- kto
@dataclass
class KTODataSection(DataSection):
    """Labelled completions: prompt, completion and a desirable (true) / undesirable (false) label."""
    train_files: list[str] = field([f"{TINY_ASSETS}/data/kto_train.jsonl"], help="training data files or folders")
    eval_files: list[str] = field([f"{TINY_ASSETS}/data/kto_eval.jsonl"], help="held-out data files or folders")
    response_key: str = field("completion", help="column with the completion text")


@dataclass
class KTOSection:
    """The KTO loss."""
    beta: float = field(0.1, min=1e-9, help="scale of the implied reward beta * log(pi / ref)")
    desirable_weight: float = field(1.0, min=0, help="lambda_D: weight of desirable rows")
    undesirable_weight: float = field(1.0, min=0, help="lambda_U: weight of undesirable rows")


@dataclass
class KTOConfig:
    output_dir: str = field("runs/kto", help="where metrics, TensorBoard, checkpoints and final/ go")
    model: ModelSection = section(ModelSection)
    ref: ReferenceSection = section(ReferenceSection)
    kto: KTOSection = section(KTOSection)
    data: KTODataSection = section(KTODataSection)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)

    def validate(self) -> None:
        refuse_packing(self.data, "kto")
        if self.train.group_by_length:
            raise ConfigError("train.group_by_length would change KTO's loss, not only its padding: the reference "
                              "point z0 is a mean over each micro-batch's mismatched pairs, so it depends on which "
                              "rows share a micro-batch")


# -------------------------------------------------------------------------------------------------- generate
@dataclass
class GenerateSection:
    """Sampling and resumable output."""
    n: int = field(4, min=1, help="samples per prompt")
    temperature: float = field(1.0, min=0, help="0 = greedy (then n must be 1)")
    top_p: float = field(1.0, min=0, max=1)
    top_k: int = field(0, min=0, help="0 = off")
    max_new_tokens: int = field(8, min=1)
    seed: int = field(0, help="sampling seed; each prompt index gets its own stream from it")
    chunk_size: int = field(64, min=1, help="prompts per resumable chunk (one done marker each)")
    max_chunks_per_job: int = field(0, min=0, help="stop after generating this many chunks on a rank (0 = no "
                                                  "limit): walltime slicing; the next job resumes")
    output_file: str = field("", help="merged JSONL (default: output_dir/generations.jsonl)")


@dataclass
class ScoreSection:
    """Optional scoring of each response in the same job."""
    functions: list[str] = field([], help="rule rewards: exact_match, path/file.py:fn or package.module:fn")
    reward_models: list[str] = field([], help="reward model folders (same tokenizer as the policy)")
    normalize: bool = field(False, help="reward models: apply the reward_mean/reward_std of their config")
    micro_batch_size: int = field(64, min=1, help="sequences per reward model forward pass")
    process_aggregate: str = field("min", choices=list(STEP_AGGREGATIONS),
                                   help="a process reward model's (hpc-rlhf prm) score of a response from its "
                                        "steps' scores; a response without a step marker gets 0")

    @property
    def enabled(self) -> bool:
        return bool(self.functions or self.reward_models)


def _prompt_data() -> DataSection:
    return DataSection(train_files=[f"{TINY_ASSETS}/data/prompts_train.jsonl"], max_eval_rows=None)


@dataclass
class GenerateConfig:
    output_dir: str = field("runs/generate", help="where chunks/, config.yaml and generations.jsonl go")
    model: ModelSection = section(ModelSection)
    data: DataSection = field(default_factory=_prompt_data, help="data.train_files are the prompts")
    generate: GenerateSection = section(GenerateSection)
    score: ScoreSection = section(ScoreSection)
    dist: DistSection = section(DistSection)


# -------------------------------------------------------------------------------------------------------- rs
@dataclass
class SelectSection:
    """Which scored samples become training data."""
    strategy: str = field("best", choices=STRATEGIES, help="best per prompt, top k per prompt, or all >= threshold")
    k: int = field(1, min=1, help="top_k: samples kept per prompt")
    threshold: float = field(0.0, help="threshold: keep every sample scoring at least this")
    min_score: float | None = field(None, help="drop kept samples scoring below this (e.g. 1 = only correct ones)")


def _rs_generate() -> GenerateSection:
    return GenerateSection(n=8, temperature=1.0)


def _rs_score() -> ScoreSection:
    return ScoreSection(functions=["exact_match"])


@dataclass
class RejectionConfig:
    output_dir: str = field("runs/rs", help="where rounds, metrics.jsonl and final/ go")
    rounds: int = field(1, min=1, help="generate -> select -> fine-tune rounds")
    sft_after: bool = field(True, help="fine-tune on the kept samples in the same job (false: only write the data)")
    model: ModelSection = section(ModelSection)
    data: DataSection = field(default_factory=_prompt_data, help="data.train_files are the prompts")
    generate: GenerateSection = field(default_factory=_rs_generate)
    score: ScoreSection = field(default_factory=_rs_score)
    select: SelectSection = section(SelectSection)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)


# ------------------------------------------------------------------------------------------------------ csft
@dataclass
class ConditionalSection:
    """How scores enter the prompt."""
    template: str = field("<score:{score}> {prompt}", help="must contain {score} and {prompt}")
    bucket_edges: list[float] = field([0.5], help="ascending score edges; len(edges)+1 buckets")
    ask_bucket: int | None = field(None, min=0, help="bucket asked for at evaluation (default: the highest)")
    response_files: list[str] = field([], help="score and label these prompt/response rows instead of sampling "
                                               "(data.prompt_key, data.response_key, optional data.answer_key)")

    def validate(self) -> None:
        for name in ("{score}", "{prompt}"):
            if name not in self.template:
                raise ConfigError(f"csft.template must contain {name}, got {self.template!r}")
        if list(self.bucket_edges) != sorted(self.bucket_edges) or len(set(self.bucket_edges)) != len(
                self.bucket_edges):
            raise ConfigError(f"csft.bucket_edges must be strictly ascending, got {self.bucket_edges}")
        if self.ask_bucket is not None and self.ask_bucket > len(self.bucket_edges):
            raise ConfigError(f"csft.ask_bucket={self.ask_bucket} but csft.bucket_edges={self.bucket_edges} make "
                              f"only buckets 0..{len(self.bucket_edges)}")

    @property
    def highest(self) -> int:
        return len(self.bucket_edges)


@dataclass
class ConditionalConfig:
    output_dir: str = field("runs/csft", help="where data/, sft/, metrics.jsonl and final/ go")
    model: ModelSection = section(ModelSection)
    data: DataSection = field(default_factory=_prompt_data, help="data.train_files are the prompts")
    generate: GenerateSection = section(GenerateSection)
    score: ScoreSection = field(default_factory=_rs_score)
    csft: ConditionalSection = section(ConditionalSection)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)


# ------------------------------------------------------------------------------------------------------ idpo
@dataclass
class PairSection:
    """How preference pairs are made from scored samples."""
    min_gap: float = field(0.0, min=0, help="drop prompts whose best and worst scores differ by no more than this")


def _idpo_dpo() -> DPOSection:
    # With the NLL term on by default: without it a good policy collapsed in one round (iterative_dpo.py's docstring).
    return DPOSection(sft_weight=1.0)


@dataclass
class IterativeDPOConfig:
    output_dir: str = field("runs/idpo", help="where rounds, metrics.jsonl and final/ go")
    rounds: int = field(2, min=1, help="generate -> pair -> DPO rounds")
    model: ModelSection = section(ModelSection)
    ref: ReferenceSection = section(ReferenceSection)
    dpo: DPOSection = field(default_factory=_idpo_dpo, help="the DPO loss of each round (NLL term on by default)")
    data: DataSection = field(default_factory=_prompt_data, help="data.train_files are the prompts")
    generate: GenerateSection = field(default_factory=_rs_generate)
    score: ScoreSection = field(default_factory=_rs_score)
    pairs: PairSection = section(PairSection)
    train: TrainSection = section(TrainSection)
    eval: GenerationEvalSection = section(GenerationEvalSection)
    log: LogSection = section(LogSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    dist: DistSection = section(DistSection)

    def validate(self) -> None:
        refuse_packing(self.data, "idpo")
        check_grouping_with_nll(self.train, self.dpo)
