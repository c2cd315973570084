"""The CPU kernel pin behind bit-identical seeded runs across machines (hpc_rlhf/utils/cpu_kernels.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc_rlhf.utils.cpu_kernels import PINNED, pin_cpu_kernels

AVX2_CPU = "processor\t: 0\nflags\t\t: fpu sse sse2 avx fma avx2 bmi2\n"
OLD_CPU = "processor\t: 0\nflags\t\t: fpu sse sse2 avx\n"


def test_an_avx2_cpu_gets_every_pin():
    env = {}
    assert pin_cpu_kernels(env, cpuinfo=AVX2_CPU, machine="x86_64") == PINNED
    assert env == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_a_value_the_user_set_is_kept():
    env = {"MKL_CBWR": "COMPATIBLE"}
    pin_cpu_kernels(env, cpuinfo=AVX2_CPU, machine="x86_64")
    assert env["MKL_CBWR"] == "COMPATIBLE" and env["ATEN_CPU_CAPABILITY"] == "avx2"


@pytest.mark.parametrize("env, cpuinfo, machine", [
    ({}, OLD_CPU, "x86_64"),                                  # AVX2 kernels would crash there
    ({}, AVX2_CPU, "aarch64"),                                # no x86 kernels to pin
    ({"HPC_RLHF_CPU_KERNELS": "native"}, AVX2_CPU, "x86_64"),  # the user's opt-out
])
def test_no_pin_where_it_cannot_or_must_not_apply(env, cpuinfo, machine):
    before = dict(env)
    assert pin_cpu_kernels(env, cpuinfo=cpuinfo, machine=machine) == {}
    assert env == before


def test_importing_the_package_pins_torch_kernels_before_torch_loads():
    with open("/proc/cpuinfo") as f:
        if "avx2" not in f.read():
            pytest.skip("this CPU has no AVX2")
    env = {k: v for k, v in os.environ.items() if k not in PINNED and k != "HPC_RLHF_CPU_KERNELS"}
    code = "import hpc_rlhf, torch, os; print(torch.backends.cpu.get_cpu_capability(), os.environ['MKL_CBWR'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AVX2", "AVX2"]
    env["HPC_RLHF_CPU_KERNELS"] = "native"
    code = "import hpc_rlhf, os; print('MKL_CBWR' in os.environ)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
