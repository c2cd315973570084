"""scripts/install_packages.py: pip's settings carried over to uv, or the install left to pip."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import install_packages  # noqa: E402
from install_packages import pip_settings, uv_options  # noqa: E402

LISTING = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.index-url='https://mirror.example/simple'
install.index-url='https://install.example/simple'
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
freeze.exclude='pip'
"""


def test_the_settings_pip_install_reads_each_once_the_environment_over_install_over_global():
    settings = pip_settings(LISTING)
    assert settings["index-url"] == "https://install.example/simple"
    assert settings["find-links"] == "/opt/wheels"
    assert "exclude" not in settings  # another command's section


def test_each_setting_becomes_its_uv_option_or_variable():
    arguments, environment = uv_options(pip_settings(LISTING))
    pairs = list(zip(arguments[::2], arguments[1::2]))
    assert pairs == [("--constraint", "/etc/xdg/pip/constraints.txt"),
                     ("--extra-index-url", "file:///opt/pypi/simple"),
                     ("--extra-index-url", "file:///opt/pypi-more/simple"),
                     ("--index-url", "https://install.example/simple"),
                     ("--find-links", "/opt/wheels"),
                     ("--index-strategy", "unsafe-best-match")]
    assert environment == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}
    assert uv_options({"no-index": "true", "pre": "0"})[0] == ["--no-index", "--index-strategy", "unsafe-best-match"]


def test_a_setting_that_changes_what_is_installed_without_a_uv_equivalent_is_named():
    with pytest.raises(ValueError, match="only-binary=':all:'"):
        uv_options({"find-links": "/opt/wheels", "only-binary": ":all:"})


def test_an_install_goes_to_pip_when_uv_cannot_follow_pip_settings(monkeypatch, capsys):
    commands = []
    monkeypatch.setattr(install_packages, "uv_binary", lambda: "/bin/uv")
    monkeypatch.setattr(install_packages.subprocess, "run", lambda command, **kwargs: (
        commands.append(command), subprocess.CompletedProcess(command, 0, "install.target='/x'\n"))[1])
    assert install_packages.main(["-q", "--no-cache-dir", "six"]) == 0
    assert commands[-1] == [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "six"]
    assert "pip setting target='/x' has no uv equivalent here: installing with pip" in capsys.readouterr().err

    monkeypatch.setattr(install_packages.subprocess, "run", lambda command, **kwargs: (
        commands.append(command), subprocess.CompletedProcess(command, 0, ":env:.find-links='/w'\n"))[1])
    assert install_packages.main(["-q", "--no-cache-dir", "six"]) == 0
    assert commands[-1] == ["/bin/uv", "pip", "install", "--python", sys.executable, "--compile-bytecode",
                            "--find-links", "/w", "--index-strategy", "unsafe-best-match", "-q", "--no-cache", "six"]


def test_an_install_goes_to_pip_when_pip_cannot_list_its_settings(monkeypatch, capsys):
    commands = []
    monkeypatch.setattr(install_packages, "uv_binary", lambda: "/bin/uv")
    monkeypatch.setattr(install_packages.subprocess, "run", lambda command, **kwargs: (
        commands.append(command), subprocess.CompletedProcess(command, 1, "", "ERROR: bad config file"))[1])
    assert install_packages.main(["six"]) == 1  # the fake answers every command with 1
    assert commands[-1] == [sys.executable, "-m", "pip", "install", "six"]
    assert "`pip config list` failed (ERROR: bad config file): installing with pip" in capsys.readouterr().err
