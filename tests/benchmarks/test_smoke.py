"""Every benchmark still runs (benchmarks/): each CPU benchmark once with its smallest settings or its `--smoke`
(no figure is asserted: a smoke run is no measurement), the GPU-only one's argument parsing. A benchmark whose code
rotted (an internal API it instruments moved, a library renamed a keyword) fails here instead of in front of a
reader of benchmarks/README.md.

- Each runs as its command would, but not in the pytest process: the four whose driver only starts worker processes
  once ran there (its imports already done), but their local launcher forks the ranks from the process it runs
  in, and forks of a pytest process that has run a thousand tests were slow: 100-165 s each in the full suite
  against 10-33 s alone (2026-11-26, AMD EPYC 2 cores). The CPU ones (COMMANDS) are forks, one after the other, of
  one fresh interpreter that imported torch, transformers, deepspeed and the RL modes once
  (tests/benchmarks/smoke_runner.py, fixture `smoke_runs`, itself forked from the tests' zygote), and so is the
  vLLM one (vLLM spawns its engine's processes itself); the TRL ones are fresh interpreters.
- The five multi-rank ones (`--smoke`: rl_phases, async_rl, memory_scaling, lora_rl, weight_sync) fork every rank
  from the benchmark's own interpreter, which imported torch, transformers, deepspeed and the RL modes once
  (benchlib.run_ranks): no interpreter per run or rank. Alone, one thread (2026-11-27, AMD EPYC 2 cores), CPU
  seconds before -> after: lora_rl 46 -> 10, async_rl 25 -> 15, memory_scaling 20 -> 13.5, rl_phases 14 -> 8.6,
  weight_sync 13.6 -> 9.4. Every code path of each script still runs (lora_rl: the sync, all three GRPO runs).
- rollout_engines runs vLLM's CPU build (marker `vllm`: installed by `make venv`, so a skip fails CI); its smoke
  run is the weight-sync section only (each section starts vLLM engines at ~15 CPU-seconds each).
- Every test here is marked `benchmarks` (the smoke runs take ~42 CPU-seconds together, about a minute alone on 2
  cores; 2026-11-27): `-m "not benchmarks"` leaves them out of a quick run.
- The TRL comparisons run where TRL is installed (TRL 1.16; ppo_vs_trl: the .venv-trl112 overlay with TRL 1.12);
  the suite's set-up does not install TRL, so in CI they are skipped and `make bench` runs them (benchmarks/README.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.utils.imports import import_target

from tests.distributed import REAL_SPAWN_VAR, REPO, run_python, worker_env

pytestmark = pytest.mark.benchmarks
BENCHMARKS = REPO / "benchmarks"
RUNNER = Path(__file__).resolve().parent / "smoke_runner.py"
COMMANDS = {
    "rl_phases": ["--smoke"],
    "async_rl": ["--smoke"],
    "memory_scaling": ["--smoke"],
    "lora_rl": ["--smoke"],
    "weight_sync": ["--smoke"],
    "packing": ["--max-lens", "32", "--rows", "64", "--rounds", "1", "--steps", "2", "--warmup", "1"],
    "rl_packing": ["--smoke"],
    "sequence_parallel": ["--smoke"],
    "multi_turn": ["--prompts", "2", "--n", "2", "--turns", "2", "--new-tokens", "2", "--repeats", "1"],
    "hf_generation": ["--prompts", "2", "--n", "2", "--new-tokens", "2", "--repeats", "1"],
    "data_setup": ["--rows", "64", "--repeats", "1"],
}
VLLM = {"rollout_engines": ["--smoke"]}
TRL = {
    "sft_dpo_vs_trl": ["--rounds", "1", "--steps", "2", "--warmup", "1", "--rows", "64", "--batch-size", "4"],
    "grpo_vs_trl": ["--algos", "grpo", "--layouts", "hybrid", "--rounds", "1", "--steps", "1", "--warmup", "1",
                    "--rows", "64"],
    "ppo_vs_trl": ["--layouts", "colocated", "--rounds", "1", "--steps", "1", "--warmup", "1", "--rows", "64"],
}
GPU_ONLY = ["gpu_throughput", "gpu_checks"]
# Reads the outputs of rl_phases runs (none given: only its table of published runs, computed), or computes from the
# memory model alone (long_context), so not in run_all.sh.
ANALYSES = {"step_time_validation": [], "long_context": ["--lengths", "8192", "--ks", "1", "4"]}
TRL_112 = REPO / ".venv-trl112" / "bin" / "python"


def load(name: str):
    """benchmarks/<name>.py as a module (it finds benchlib beside it)."""
    return import_target(str(BENCHMARKS / f"{name}.py"), "benchmark_")


def run(name: str, args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{name} {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - {"benchlib"}
    listed = set(COMMANDS) | set(VLLM) | set(TRL) | set(GPU_ONLY) | set(ANALYSES)
    assert scripts == listed, f"not listed here: {sorted(scripts - listed)}; gone: {sorted(listed - scripts)}"
    run_all = (BENCHMARKS / "run_all.sh").read_text()
    assert all(name in run_all for name in scripts - set(GPU_ONLY) - set(ANALYSES)), \
        "run_all.sh leaves out a CPU benchmark"


# Session-scoped: the suite runs vLLM's tests first (tests/conftest.py), this file's vLLM one among them, and the
# rest of the file later; a module-scoped fixture was made again for the second part and ran every benchmark twice
# (fresh-clone suite of 2026-11-29: 109 s at the lane's start, 225 s later, ~150 CPU-seconds each).
@pytest.fixture(scope="session")
def smoke_runs(request, tmp_path_factory):
    """The selected test_smoke_run benchmarks, run one after the other by tests/benchmarks/smoke_runner.py: each
    as a fork of one interpreter that imported the heavy libraries once (saves ~7 CPU-seconds per benchmark). Once
    per session, whichever of them runs first."""
    here = [item for item in request.session.items if item.path == Path(__file__)]
    names = [item.callspec.params["name"] for item in here if getattr(item, "originalname", None) == "test_smoke_run"]
    if any(item.name == "test_rollout_engines_smoke_run" for item in here) and importlib.util.find_spec("vllm"):
        names.append("rollout_engines")
    out = tmp_path_factory.mktemp("smoke_runs")
    commands = {**COMMANDS, **VLLM}
    # Forked from the tests' zygote (tests/distributed.py run_python), its imports done. vLLM spawns the engine cores
    # of rollout_engines itself: the benchmark's environment (benchlib) is not the tests', and the spawned children's
    # zygote serves the environment of the first engine core it gets.
    proc = run_python(None, str(RUNNER), [str(out), "900", json.dumps({n: commands[n] for n in names})],
                      env=worker_env({REAL_SPAWN_VAR: "1"}), timeout=900 * len(names) + 60)
    return out, proc


def smoke_output(name: str, smoke_runs) -> str:
    """The stdout of benchmarks/<name>.py's smoke run, which exited 0."""
    out, runner = smoke_runs
    rc = out / f"{name}.rc"
    assert rc.exists(), f"smoke_runner.py exited {runner.returncode}:\n{runner.stdout[-3000:]}\n{runner.stderr[-6000:]}"
    stdout, stderr = ((out / f"{name}.{kind}").read_text() for kind in ("out", "err"))
    assert rc.read_text() == "0", f"{name}: exit {rc.read_text()}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_smoke_run(name, smoke_runs):
    assert "---" in smoke_output(name, smoke_runs)


@pytest.mark.parametrize("name", list(ANALYSES))
def test_analysis_runs(name, capsys):
    assert load(name).main(ANALYSES[name]) == 0
    assert "|---" in capsys.readouterr().out


@pytest.mark.vllm
def test_rollout_engines_smoke_run(smoke_runs):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM's CPU build is not installed (make venv installs it)")
    out = smoke_output("rollout_engines", smoke_runs)
    assert "2. weight sync" in out and "bit for bit: True" in out


@pytest.mark.parametrize("name", list(TRL))
def test_trl_comparison_smoke_run(name):
    if name == "ppo_vs_trl" and not TRL_112.exists():
        pytest.skip("no .venv-trl112 (TRL 1.12, for PPOTrainer): `make bench` makes it (benchmarks/run_all.sh)")
    if name != "ppo_vs_trl" and importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed: `make bench` installs it (pip install --no-deps -r "
                    "benchmarks/requirements.txt)")
    assert "---" in run(name, TRL[name]).stdout


def test_the_gpu_checks_refuse_a_machine_without_a_gpu_and_skip_what_they_cannot_run(capsys):
    module = load("gpu_checks")
    assert module.main([]) == 2 and "no CUDA GPU here" in capsys.readouterr().err
    one_gpu, two = module.checks(sys.executable, 1), module.checks(sys.executable, 2)
    assert list(one_gpu) == ["nccl", "bf16 train", "generation", "packed rl", "sequence parallel", "vllm",
                             "weight sync"]
    assert module.run_check("weight sync", one_gpu["weight sync"]) == ("skipped", 0.0, "two NCCL ranks need two GPUs")
    assert two["weight sync"]["skip"] is None
    missing = dict(one_gpu["vllm"], needs="hpc_rlhf_no_such_module")
    assert module.run_check("vllm", missing) == ("skipped", 0.0, "hpc_rlhf_no_such_module is not installed")
    outcome, _, line = module.run_check("x", {"cmd": [sys.executable, "-c", "import sys; sys.exit('boom')"],
                                               "timeout": 60, "headline": "^never$"})
    assert outcome == "FAILED" and line == "exit 1: boom"


def test_the_one_gpu_mode_of_sequence_parallel_refuses_a_machine_without_a_gpu(capsys):
    """Its GPU run is gpu_checks' "sequence parallel"; here only its arguments and the refusal."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: benchmarks/gpu_checks.py runs this mode")
    module = load("sequence_parallel")
    assert module.main(["--device", "cuda", "--require-flash"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        module.main(["--device", "cuda", "--tokens", "30"])
    assert exited.value.code == 2 and "--tokens must be a multiple of 4" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gpu_throughput"])
def test_gpu_benchmark_parses_its_arguments(name, capsys):
    module = load(name)
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0 and "--zero-stage" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        module.main(["--zero-stage", "5"])
    assert exited.value.code == 2 and "--zero-stage: invalid choice: 5" in capsys.readouterr().err
