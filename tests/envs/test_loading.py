"""Naming an environment: a file, a module, a built-in, or a URL; and the env config section."""

from __future__ import annotations

import sys
import textwrap

import pytest

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.envs.base import EnvError
from hpc_rlhf.envs.calculator import Calculator
from hpc_rlhf.envs.config import EnvSection
from hpc_rlhf.envs.guess_number import GuessNumber
from hpc_rlhf.envs.http import HttpEnvironment
from hpc_rlhf.envs.loading import load_environment, load_environment_class

ENV_FILE = textwrap.dedent('''
    class Countdown:
        stop_strings = ("!",)

        def reset(self, row):
            self.left = int(row["n"])
            return str(self.left)

        def step(self, action):
            self.left -= 1
            return str(self.left), 1.0, self.left == 0

    def not_a_class():
        pass

    class NoStep:
        def reset(self, row):
            return ""
''')


@pytest.fixture()
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    return path


def test_by_file_by_module_and_built_in_names(env_file, tmp_path, monkeypatch):
    cls = load_environment_class(f"{env_file}:Countdown")
    env = cls()
    assert env.reset({"n": 2}) == "2" and env.step("x") == ("1", 1.0, False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_environment_class("my_env:Countdown").__name__ == "Countdown"
    assert load_environment_class("calculator") is Calculator
    assert load_environment_class("guess_number") is GuessNumber
    assert load_environment_class("hpc_rlhf.envs.calculator:Calculator") is Calculator
    sys.modules.pop("my_env", None)


def test_the_factory_makes_one_environment_per_episode_with_its_stop_strings(env_file):
    factory = load_environment(EnvSection(name=f"{env_file}:Countdown", stop=["?", "!"], timeout_s=7))
    assert factory.make() is not factory.make()
    assert factory.stop_strings == ("?", "!") and factory.call_timeout_s == 7 and factory.name.endswith(":Countdown")
    assert load_environment(EnvSection(name="calculator")).stop_strings == ("</calc>",)
    http = load_environment(EnvSection(http_url="http://127.0.0.1:1/env", timeout_s=2, retries=1))
    env = http.make()
    assert isinstance(env, HttpEnvironment) and env.url == "http://127.0.0.1:1/env" and env.retries == 1
    assert http.name == "http://127.0.0.1:1/env"


@pytest.mark.parametrize("spec, message", [
    ("nothing", "environment 'nothing' must look like path/to/file.py:Class or package.module:Class "
                "(built-ins: calculator, guess_number)"),
    ("missing.py:Env", "environment 'missing.py:Env': file missing.py does not exist"),
    ("hpc_rlhf.no_such_module:Env", "environment 'hpc_rlhf.no_such_module:Env': importing hpc_rlhf.no_such_module "
                                    "failed: ModuleNotFoundError"),
    ("{file}:Nope", "environment '{file}:Nope': {file} has no 'Nope'"),
    ("{file}:not_a_class", "environment '{file}:not_a_class': 'not_a_class' is a function, not a class"),
    ("{file}:NoStep", "environment '{file}:NoStep': class NoStep has no step method"),
])
def test_bad_names_get_one_line(env_file, spec, message):
    spec, message = spec.format(file=env_file), message.format(file=env_file)
    with pytest.raises(EnvError) as caught:
        load_environment_class(spec)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_file_that_fails_to_import_says_why(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import nothing_here_at_all\n")
    with pytest.raises(EnvError, match=r"importing .*broken.py failed: ModuleNotFoundError: No module named "
                                       r"'nothing_here_at_all'"):
        load_environment_class(f"{bad}:Env")


def test_bad_stop_strings_of_a_class_are_refused(tmp_path):
    path = tmp_path / "stops.py"
    path.write_text("class Env:\n    stop_strings = '</a>'\n    def reset(self, row): return ''\n"
                    "    def step(self, a): return '', 0.0, True\n")
    with pytest.raises(EnvError, match="stop_strings must be a list of non-empty strings, got '</a>'"):
        load_environment(EnvSection(name=f"{path}:Env"))


def test_env_section_from_yaml_and_overrides(tmp_path):
    from dataclasses import dataclass

    from hpc_rlhf.config import section

    @dataclass
    class Holder:
        env: EnvSection = section(EnvSection)

    path = tmp_path / "c.yaml"
    path.write_text("env:\n  name: calculator\n  max_turns: 3\n  stop: ['</calc>']\n")
    cfg = load_config(Holder, path, ["env.on_error=skip", "env.timeout_s=2.5"])
    assert cfg.env.name == "calculator" and cfg.env.max_turns == 3 and cfg.env.stop == ["</calc>"]
    assert cfg.env.on_error == "skip" and cfg.env.timeout_s == 2.5 and cfg.env.enabled
    assert cfg.env.observation_role == "tool" and not Holder().env.enabled
    for overrides, message in ((["env.on_error=ignore"], "env.on_error"), (["env.max_turns=0"], "env.max_turns"),
                               (["env.http_url=http://x"], "both set"), (["env.timeout_s=0"], "timeout_s must be > 0"),
                               (["env.stop=['']"], "empty string")):
        with pytest.raises(ConfigError, match=message):
            load_config(Holder, path, overrides)
