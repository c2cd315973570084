"""One CPU kernel path on every x86 machine, so that a seeded CPU run gives the same bits everywhere.

Measured on this project's CI machines (AMD EPYC, torch 2.13 CPU wheel, 60 seeded SFT steps): the metrics are
bit-identical under load (three busy processes beside the run), with 1 or 2 threads, and with forked or exec'd
local ranks, but they change as soon as the kernel path changes: ATen's vectorised kernels (`default` instead of
`avx2`) or MKL's code path (`MKL_CBWR=COMPATIBLE`) alter the last bits of the loss at step 5 and the run drifts
from there. Which path a library takes depends on the processor: a machine with AVX-512 (a Zen 4 EPYC, most
recent Xeons) takes other kernels than an AVX2-only one (Zen 3), so the same seed gave other figures on another
machine of the same pool. Pinning ATen, MKL and oneDNN to AVX2 makes every x86-64 machine that has AVX2 take
the same path; it is the path an AVX2 machine takes anyway (same bits as unpinned there).

What the pin cannot do: agree across processor vendors. MKL's AVX2 branch is Intel's; on an AMD processor
oneMKL's documentation says MKL_CBWR=AVX2 falls back to its AUTO branch, so an Intel and an AMD machine take other
code paths. Measured on 2026-11-25: the test suite's seed-0 SFT base reached 0.58 held-out exact match on an Intel
Xeon (AVX-512) where the AMD EPYC machines gave 0.62-0.80 at seeds 0-4, and three learning tests failed there
(README: the learning tests are calibrated on both). The branch documented to agree across vendors,
MKL_CBWR=COMPATIBLE (SSE2; not checked here, no AMD machine at hand), doubled the time of 30 training steps of the
tiny model (3.7 s -> 7.4 s on one thread), so it is not the default; a user who needs it sets it (a variable the
user set is kept).

It must happen before torch loads MKL or dispatches its first kernel, hence environment variables set when the
package is imported. A variable the user set is left as it is; `HPC_RLHF_CPU_KERNELS=native` turns the pin off
(for speed on AVX-512 machines, where exact agreement with other machines does not matter). GPU kernels are
not affected.
"""

from __future__ import annotations

import os
import platform

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def pin_cpu_kernels(environ=os.environ, cpuinfo: str | None = None, machine: str | None = None) -> dict[str, str]:
    """Set the AVX2 pins in `environ` where the CPU can run them; returns what was set."""
    if environ.get("HPC_RLHF_CPU_KERNELS", "avx2") == "native":
        return {}
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return {}
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return {}
    if not {"avx2", "fma"} <= cpu_flags(cpuinfo):  # asking for AVX2 kernels on a CPU without them would crash
        return {}
    added = {k: v for k, v in PINNED.items() if k not in environ}
    environ.update(added)
    return added
