#!/usr/bin/env bash
# Checks, without building the image, that the compiled parts containers/hpc_rlhf.def installs agree on the CUDA
# major version: it downloads the Linux x86_64 wheels of torch (the PyPI build the image installs) and vLLM, opens
# every compiled module in them and lists the CUDA runtime libraries each one links (libcudart.so.N,
# libnvrtc.so.N, libcublas.so.N). bitsandbytes is left out: its wheel carries one library per CUDA version and
# loads the one matching torch's; flash-attn and DeepSpeed's ops are compiled in the image by the base image's
# CUDA toolkit, which torch's extension builder refuses when its major differs from torch's. Different majors mean a module that fails to load in the image
# (vLLM 0.32.0's ops link libcudart.so.13: beside a CUDA 12 torch they fail when the first engine starts, after
# every rank has loaded its model). Not part of the test suite or CI: the wheels are about 1 GB.
#
#   bash containers/check_cuda_runtimes.sh        # from the repository root; exit 0 = one CUDA major everywhere
#   WHEELS=/tmp/wheels bash containers/check_cuda_runtimes.sh    # keep (and reuse) the downloaded wheels
#
# Needs python3 with pip, unzip and readelf (binutils). The last run's output is in docs/launching.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
WHEELS=${WHEELS:-$(mktemp -d)}
mkdir -p "$WHEELS"
export PIP_CONFIG_FILE=/dev/null  # this machine's pip settings (local CPU wheels) must not choose the image's wheels
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT || true

torch_spec=$(grep -oE '"torch==[0-9.]+"' containers/hpc_rlhf.def | head -n 1 | tr -d '"')
vllm_spec=$(grep -oE '^vllm==[0-9.]+' requirements-gpu.txt)
specs=("$torch_spec" "$vllm_spec")
echo "wheels for Linux x86_64, CPython $PY_VERSION: ${specs[*]} (into $WHEELS)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_35_x86_64 \
  --platform manylinux2014_x86_64 --index-url https://pypi.org/simple -d "$WHEELS" "${specs[@]}"

majors=()
for wheel in "$WHEELS"/*.whl; do
  name=$(basename "$wheel")
  case "$name" in torch-*|vllm-*) ;; *) continue ;; esac
  unpacked=$(mktemp -d)
  unzip -q -o "$wheel" '*.so' '*.so.*' -d "$unpacked" 2>/dev/null || true
  seen=$(find "$unpacked" -name '*.so*' -type f -exec readelf -d {} \; 2>/dev/null \
         | grep -oE 'lib(cudart|nvrtc|cublas)\.so\.[0-9]+' | sort -u | tr '\n' ' ')
  rm -rf "$unpacked"
  echo "  $name: ${seen:-no CUDA runtime linked}"
  for lib in $seen; do majors+=("${lib##*.so.}"); done
done
distinct=$(printf '%s\n' "${majors[@]}" | sort -u | tr '\n' ' ')
if [ "$(printf '%s\n' "${majors[@]}" | sort -u | wc -l)" -ne 1 ]; then
  echo "CUDA majors disagree: $distinct- every compiled module of the image must link one major" >&2
  exit 1
fi
major=${distinct%% *}
base=$(grep -E '^From:' containers/hpc_rlhf.def | grep -oE 'cuda[:-]?[0-9]+' | grep -oE '[0-9]+$' | head -n 1)
echo "one CUDA major in the wheels: $major; the base image ($(grep -E '^From:' containers/hpc_rlhf.def | cut -d' ' -f2)):" \
     "CUDA ${base:-unknown}"
if [ "$base" != "$major" ]; then
  echo "the base image's CUDA toolkit (it compiles flash-attn and DeepSpeed's ops) must be CUDA $major" >&2
  exit 1
fi
