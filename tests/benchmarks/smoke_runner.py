"""Run benchmark smoke commands one after the other, each as a fork of this interpreter, which imported torch,
transformers, deepspeed and hpc_rlhf's RL modes once (tests/benchmarks/test_smoke.py's `smoke_runs`).

    python tests/benchmarks/smoke_runner.py OUT_DIR TIMEOUT_S '{"NAME": [ARGS...], ...}'

Each benchmarks/NAME.py runs as `python benchmarks/NAME.py ARGS` would (as `__main__`, sys.argv set), in a process
of its own (a fork: what one benchmark changes stays out of the next), with its stdout and stderr in
OUT_DIR/NAME.out and OUT_DIR/NAME.err and its exit code in OUT_DIR/NAME.rc ("timeout" after TIMEOUT_S seconds,
when it is killed). A fresh interpreter per benchmark spent ~7 CPU-seconds on those imports, most of a smoke run.
The benchmarks' multi-rank smoke runs fork their ranks in turn (benchlib.run_ranks).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_one(script: Path, args: list[str], out: Path, name: str) -> int:
    """In the fork: run the script as `python script args`; return its exit code."""
    os.setsid()  # its own process group: a timeout kills it with whatever it started
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(out / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
        return 0
    except SystemExit as exc:  # as an interpreter ends on sys.exit(...)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as an interpreter ends on an uncaught exception
        traceback.print_exc()
        return 1


def main(argv: list[str]) -> int:
    out, timeout_s, runs = Path(argv[0]), float(argv[1]), json.loads(argv[2])
    sys.path.insert(0, str(BENCHMARKS))
    import benchlib

    benchlib.single_thread_env()  # before torch is imported: one thread
    import hpc_rlhf  # noqa: F401  (pins the CPU kernels before torch loads, as in every rank)
    import torch

    from hpc_rlhf.launch.local import import_what_ranks_use

    torch.set_num_threads(1)
    import_what_ranks_use()
    for module in benchlib.RANK_IMPORTS:
        importlib.import_module(module)
    for name, args in runs.items():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_one(BENCHMARKS / f"{name}.py", args, out, name)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code & 0xFF)
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                result = str(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                result = "timeout"
                break
            time.sleep(0.1)
        (out / f"{name}.rc").write_text(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
