#!/usr/bin/env bash
# Run every CPU benchmark with its default settings and keep the printed tables.
#   bash benchmarks/run_all.sh            (from anywhere; PY=... picks another interpreter)
# Output: the tables on stdout and in runs/bench/<time>/results.txt, each benchmark's stderr (progress bars,
# library warnings) next to it. Roughly 15-25 minutes on a shared 2-core machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/bench/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false \
       HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if ! "$PY" -c "import trl" 2>/dev/null; then
    echo "TRL is not installed: $PY -m pip install --no-deps -r benchmarks/requirements.txt" >&2
    exit 2
fi

# TRL 1.12 (PPOTrainer) as an overlay on the project venv: its own site-packages first, then the project's.
make_trl112() {
    local site main_site
    "$PY" -m venv --without-pip .venv-trl112 || return 1
    site=$(.venv-trl112/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
    main_site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
    echo "import site; site.addsitedir('$main_site')" > "$site/project_venv.pth"
    "$PY" -m pip install -q --no-deps --target "$site" trl==1.12.0
}
if [ ! -x .venv-trl112/bin/python ] && ! make_trl112; then
    echo "could not create .venv-trl112 (TRL 1.12); ppo_vs_trl will be skipped" >&2
fi

failed=0
for bench in weight_sync packing rl_packing sequence_parallel multi_turn hf_generation data_setup sft_dpo_vs_trl grpo_vs_trl rl_phases memory_scaling lora_rl \
             rollout_engines async_rl ppo_vs_trl; do
    if [ "$bench" = ppo_vs_trl ] && [ ! -x .venv-trl112/bin/python ]; then
        echo "== ppo_vs_trl skipped: no .venv-trl112" | tee -a "$OUT/results.txt"
        continue
    fi
    echo "\$ $PY benchmarks/$bench.py" | tee -a "$OUT/results.txt"
    started=$SECONDS
    if ! "$PY" "benchmarks/$bench.py" 2> "$OUT/$bench.stderr" | tee -a "$OUT/results.txt"; then
        echo "!! $bench failed; see $OUT/$bench.stderr" | tee -a "$OUT/results.txt"
        failed=1
    fi
    echo "   ($bench took $((SECONDS - started)) s)" | tee -a "$OUT/results.txt"
    echo | tee -a "$OUT/results.txt"
done
echo "results: $OUT/results.txt"
exit $failed
