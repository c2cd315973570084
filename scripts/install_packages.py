"""`pip install ARGS` for `make venv`, done by uv when it is installed in the environment, with pip's settings.

uv installs the same packages as pip in a fraction of the time (2-core Intel VM, 2026-11-30: torch and the pinned
libraries, bytecode compiled, 129 s -> 54 s), but it reads none of pip's configuration, which is how a cluster
points installs at its mirror or a local wheel folder. So this reads pip's settings (`pip config list`: its files
and PIP_* variables) and passes on each one that has a uv equivalent. A setting that could change what is
installed and has none (`only-binary`, `target`, ...) sends the install to pip, named in a message; so does an
environment without uv. Either way the command is `ARGS` as pip reads it.

    python scripts/install_packages.py -q -r requirements-cpu.txt
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip settings whose values are lists (whitespace-separated in pip's files) and uv's option for each value.
LIST_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
                "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
# pip switches and uv's option when the switch is on.
SWITCHES = {"no-index": "--no-index", "pre": "--prerelease=allow"}
# pip settings uv reads from the environment instead.
ENVIRONMENT = {"cert": "SSL_CERT_FILE", "client-cert": "SSL_CLIENT_CERT", "timeout": "UV_HTTP_TIMEOUT",
               "default-timeout": "UV_HTTP_TIMEOUT"}
# pip settings that change how pip talks or where it caches, not what it installs.
NO_EFFECT = {"disable-pip-version-check", "no-cache-dir", "cache-dir", "progress-bar", "quiet", "verbose",
             "no-color", "no-input", "root-user-action", "retries", "require-virtualenv", "log", "exists-action",
             "no-python-version-warning", "break-system-packages", "use-feature", "keyring-provider"}
# pip's sections that apply to `pip install`, the later one winning (as pip reads them).
SECTIONS = ("global", "install", ":env:")
TRUE = {"1", "true", "yes", "on"}
# pip-install arguments spelled otherwise by uv.
RENAMED_ARGUMENTS = {"--no-cache-dir": "--no-cache"}


def pip_settings(listing: str) -> dict[str, str]:
    """The settings `pip config list` prints (`section.key='value'`), each key once, as `pip install` sees it."""
    by_section: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not (sep and dot) or section not in SECTIONS:
            continue
        by_section.setdefault(section, {})[key] = ast.literal_eval(value)
    settings: dict[str, str] = {}
    for section in SECTIONS:
        settings.update(by_section.get(section, {}))
    return settings


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's arguments and environment for pip's settings; ValueError naming a setting uv cannot follow."""
    arguments: list[str] = []
    environment: dict[str, str] = {}
    for key, value in settings.items():
        if key in LIST_OPTIONS:
            for item in value.split():
                arguments += [LIST_OPTIONS[key], item]
        elif key in SWITCHES:
            if value.strip().lower() in TRUE:
                arguments.append(SWITCHES[key])
        elif key in ENVIRONMENT:
            environment[ENVIRONMENT[key]] = value
        elif key == "proxy":
            environment["HTTP_PROXY"] = environment["HTTPS_PROXY"] = value
        elif key not in NO_EFFECT:
            raise ValueError(f"pip setting {key}={value!r} has no uv equivalent here")
    # pip takes the best version over all its indexes; uv by default stops at the first index that has the name.
    return arguments + ["--index-strategy", "unsafe-best-match"], environment


def uv_binary() -> str | None:
    try:
        from uv import find_uv_bin
    except ImportError:
        return None
    return find_uv_bin()


def main(pip_arguments: list[str]) -> int:
    pip = [sys.executable, "-m", "pip"]
    uv = uv_binary()
    if uv is not None:
        listed = subprocess.run(pip + ["config", "list"], capture_output=True, text=True)
        try:
            if listed.returncode != 0:
                raise ValueError(f"`pip config list` failed ({listed.stderr.strip()[-300:]})")
            arguments, environment = uv_options(pip_settings(listed.stdout))
        except (ValueError, SyntaxError) as error:
            print(f"install_packages: {error}: installing with pip", file=sys.stderr)
        else:
            command = [uv, "pip", "install", "--python", sys.executable, "--compile-bytecode", *arguments,
                       *(RENAMED_ARGUMENTS.get(argument, argument) for argument in pip_arguments)]
            return subprocess.run(command, env={**os.environ, **environment}).returncode
    return subprocess.run(pip + ["install", *pip_arguments]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
