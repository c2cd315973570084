from dataclasses import dataclass

import pytest

from hpc_rlhf.config import (ConfigError, DataSection, TrainSection, field, format_help, load_config,
                             parse_override, section)


@dataclass
class Inner:
    lr: float = field(1e-3, min=0)
    stage: int = field(0, choices=[0, 1, 2, 3])
    tags: list[str] = field(["a"])


@dataclass
class Cfg:
    output_dir: str = field("runs/x")
    seed: int = field(0)
    name: str | None = field(None)
    flag: bool = field(False)
    train: Inner = section(Inner)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_file_and_overrides_apply_in_order(tmp_path):
    p = write(tmp_path, "seed: 3\ntrain:\n  lr: 0.5\n")
    cfg = load_config(Cfg, p, ["train.lr=1e-5", "flag=true", "train.tags=[x, y]", "name=run7"])
    assert cfg.seed == 3 and cfg.train.lr == 1e-5 and cfg.flag is True
    assert cfg.train.tags == ["x", "y"] and cfg.name == "run7" and cfg.train.stage == 0


def test_unknown_key_in_file_names_file_and_nearest(tmp_path):
    p = write(tmp_path, "train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'train\.lrr'; did you mean 'train\.lr'"):
        load_config(Cfg, p)


def test_unknown_override_suggests_section_key():
    with pytest.raises(ConfigError, match=r"command line: unknown key 'lr'; did you mean 'train\.lr'"):
        load_config(Cfg, None, ["lr=0.1"])


@pytest.mark.parametrize("override,message", [
    ("seed=abc", "key 'seed' must be an integer"),
    ("flag=3", "key 'flag' must be true or false"),
    ("train.lr=-1", "key 'train.lr' must be >= 0"),
    ("train.stage=4", r"key 'train.stage' must be one of \[0, 1, 2, 3\]"),
    ("train.lr=[1, 2]", "key 'train.lr' must be a number"),
    ("seed", "not of the form key=value"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, None, [override])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Cfg, write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Cfg, write(tmp_path, "a: [1\n"))


def test_parse_override_reads_yaml_values():
    assert parse_override("a=1e-5") == ("a", 1e-5)
    assert parse_override("a=3") == ("a", 3)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=x=y") == ("a", "x=y")


def test_help_lists_every_key_with_default():
    text = format_help(Cfg)
    for key in ("output_dir", "seed", "train.lr", "train.stage", "train.tags"):
        assert key in text
    assert "[0|1|2|3]" in text


def test_shared_sections_load_from_yaml(tmp_path):
    @dataclass
    class Mode:
        train: TrainSection = section(TrainSection)
        data: DataSection = section(DataSection)

    cfg = load_config(Mode, write(tmp_path, "train:\n  zero_stage: 3\ndata:\n  train_files: a.jsonl\n"))
    assert cfg.train.zero_stage == 3 and cfg.data.train_files == ["a.jsonl"]


def test_section_override_keeps_the_modes_own_section_defaults():
    import dataclasses as dc

    @dataclass
    class Mode:
        train: TrainSection = dc.field(default_factory=lambda: TrainSection(lr=5e-5, warmup_steps=0))

    cfg = load_config(Mode, None, ["train.max_steps=4"])
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.max_steps) == (5e-5, 0, 4)
