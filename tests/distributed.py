"""Run a script on N local ranks (gloo, one thread per rank) and check that it succeeded.

A distributed test keeps its worker code in the test module itself and calls `run_ranks(N, __file__, "case-name",
*args)`; the module ends with `if __name__ == "__main__": run_worker({"case-name": worker, ...})`, which runs
`worker(*args)` on every rank of a gloo world.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable

from hpc_rlhf.utils.cpu_kernels import pin_cpu_kernels

REPO = Path(__file__).resolve().parents[1]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        env.pop(key, None)
    env.update(extra or {})
    pin_cpu_kernels(env)  # worker scripts may import torch before hpc_rlhf
    return env


def run_ranks(nproc: int, script: str | Path, *args: str, timeout: float = 180,
              env: dict[str, str] | None = None, check: bool = True,
              launcher: str = "fork") -> subprocess.CompletedProcess:
    """`launcher="fork"`: the ranks are forks of one interpreter that imported the heavy libraries once
    (tests/fork_ranks.py); `"torchrun"`: torchrun's agent and workers, for the tests about torchrun itself."""
    if launcher == "fork":
        proc = run_python(None, str(REPO / "tests" / "fork_ranks.py"), [str(nproc), str(script), *args],
                          env=worker_env(env), timeout=timeout)
    elif launcher == "torchrun":
        proc = torchrun(["--standalone", f"--nproc_per_node={nproc}", "--max_restarts=0", "--monitor_interval=0.5",
                         str(script), *args], env=worker_env(env), timeout=timeout)
    else:
        raise ValueError(f"run_ranks: launcher must be 'fork' or 'torchrun', not {launcher!r}")
    if check and proc.returncode != 0:
        raise AssertionError(f"{nproc}-rank run of {Path(script).name} {' '.join(args)} failed "
                             f"(exit {proc.returncode}):\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-10000:]}")
    return proc


def run_worker(cases: dict[str, Callable[..., object]], timeout_s: float | None = None) -> None:
    """A worker script's `__main__` on each rank: join a gloo world (one thread per rank; `timeout_s` bounds its
    collectives, torch's default when None), run the case named by sys.argv[1] with the arguments after it (as
    strings), and leave the world together once every rank has finished the case."""
    import torch
    import torch.distributed as dist

    # Checked before joining, so that a misnamed case costs no rendezvous and fails with one line, not a traceback.
    script = Path(sys.argv[0]).name
    if len(sys.argv) < 2:
        raise SystemExit(f"{script}: no worker case given; its cases: {', '.join(cases)}")
    case, args = sys.argv[1], sys.argv[2:]
    if case not in cases:
        raise SystemExit(f"{script}: no worker case {case!r}; its cases: {', '.join(cases)}")
    torch.set_num_threads(1)
    if timeout_s is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    cases[case](*args)
    dist.barrier()
    dist.destroy_process_group()


def rank_python(env: dict[str, str]) -> str:
    """The `python` to start a rank of `env` with, where a test starts ranks itself: the stand-in of the zygote
    for `env` (tests/zygote_python.py: a process of its own whose rank is forked, its descriptors, exit and signals
    the rank's), else the interpreter itself."""
    zygote = zygote_for(env)
    return zygote.rank_python if zygote is not None and zygote.rank_python else sys.executable


def torchrun(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run ARGS`, its agent and its workers forked from the tests' zygote: the agent
    starts each worker as `PYTHON_EXEC -u ...` (torchrun's own setting), and PYTHON_EXEC names the zygote's
    stand-in script (tests/zygote_python.py), as the local Slurm's ranks are started. Each worker is still a
    process of torchrun's with torchrun's environment; it does not pay the imports again (~5 CPU-seconds a rank)."""
    python = rank_python(env)
    if python != sys.executable:
        env = {**env, "PYTHON_EXEC": python}
    return run_python("torch.distributed.run", None, args, env=env, timeout=timeout)


def _raise_priority(by: int):
    """A pre-exec hook that lowers the child's niceness by `by`, where this user may (root), and does nothing
    where it may not: a priority only changes who waits for whom, never a result."""
    def hook() -> None:
        try:
            os.nice(-by)
        except OSError:
            pass
    return hook


def hpc_rlhf_cli(*args: str, timeout: float = 900, check: bool = True, threads: int = 1,
                 env: dict[str, str] | None = None, priority: int = 0) -> subprocess.CompletedProcess:
    """`python -m hpc_rlhf ARGS` as a user types it (the local launcher starts the ranks the placement needs), forked
    from the zygote of its environment (below), which runs it as a fresh interpreter would.
    `priority` > 0 lowers the job's niceness by that much where allowed (tests/recipes.py says why)."""
    # The thread count fixes the order of float sums, and the learning tests were measured with theirs (the PPO
    # test's reward model: 0.97 held-out accuracy on 2 threads, 0.80 on 1). Threads spin while they wait
    # (OpenMP's default): on a quiet machine that was measured 1.6x faster than OMP_WAIT_POLICY=PASSIVE (200 SFT
    # base steps: 38 s against 60 s), though beside another busy process it is the slower one by far.
    full_env = worker_env({"OMP_NUM_THREADS": str(threads), **(env or {})})
    proc = run_python("hpc_rlhf", None, list(args), env=full_env, timeout=timeout, priority=priority)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpc-rlhf {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


# ------------------------------------------------------------------------------------------ the zygotes
# The tests' command lines fork from a pre-imported interpreter (tests/cli_zygote.py says why and how). What a
# library reads from the environment when it is imported (threads, kernels, accelerators, offline switches) is
# fixed in a zygote, so each set of such variables has a zygote of its own, started by its first request (up to
# MAX_ZYGOTES; further sets start fresh interpreters, as every request does with
# HPC_RLHF_TEST_FRESH_INTERPRETERS=1).
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "ATEN_", "ONEDNN", "DNNL", "TORCH", "PYTORCH",
                        "DS_", "DEEPSPEED", "HF_", "TRANSFORMERS", "TOKENIZERS", "DATASETS", "CUDA", "NCCL", "VLLM",
                        "PYTHON", "LD_", "MALLOC", "HPC_RLHF_CPU_KERNELS")
# What torchrun sets for its workers (and its agent for itself), which only its own code and the process groups read
# once they run: a torchrun worker is served by the zygote of its agent's environment. vLLM reads its sockets'
# folder (set per engine, hpc_rlhf.engines.rollout.vllm) when it makes a socket, not when it is imported.
RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC", "VLLM_RPC_BASE_PATH")
FRESH_VAR = "HPC_RLHF_TEST_FRESH_INTERPRETERS"
MAX_ZYGOTES = 4


def import_time_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that a library may read when it is imported, sorted, `LD_LIBRARY_PATH` as the folders
    the dynamic linker would search. `PYTHON` is the launch scripts' interpreter command (launch/env.sh), which no
    interpreter reads."""
    chosen = {k: v for k, v in env.items()
              if k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHON" and not k.startswith(RUN_TIME)}
    if library_search_path(chosen.pop("LD_LIBRARY_PATH", "")):  # none searched: as if unset
        chosen["LD_LIBRARY_PATH"] = library_search_path(env["LD_LIBRARY_PATH"])
    return tuple(sorted(chosen.items()))


def library_search_path(value: str) -> str:
    """`LD_LIBRARY_PATH` as the folders it names that exist, each once, in order: what the linker finds through it.
    OpenCV's loader, which vLLM's imports run, prepends a folder that does not exist and, to an unset variable, an
    empty entry (the working directory, where no run keeps libraries), in every process that imports it, so ranks
    of one job otherwise differ by how many processes imported it on their way."""
    folders = [entry for entry in value.split(":") if entry and os.path.isdir(entry)]
    return ":".join(dict.fromkeys(folders))


class ZygoteRefused(Exception):
    """The zygote's import-time environment is not the request's (the variables that differ): run it fresh."""


class Zygote:
    """One zygote: started by `start(env)`, stopped by `stop()` (at the latest when this process exits)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.path = ""
        self.rank_python = ""  # a stand-in script for ranks another launcher starts (not for a spawn zygote)

    def start(self, env: dict[str, str], on_first_request: bool = False, with_vllm: bool = True) -> None:
        folder = tempfile.mkdtemp(prefix="hpc_rlhf_zygote_")  # mode 0700: no one else may connect
        self.path = os.path.join(folder, "socket")
        # It ends when this process does (it watches its parent): not by PR_SET_PDEATHSIG, which would end it with
        # the thread that started it (the first request may come from a thread of tests/background.py).
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_zygote.py"), self.path,
                                      *(["--on-first-request"] if on_first_request else []),
                                      *([] if with_vllm else ["--without-vllm"])], cwd=REPO,
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"tests/cli_zygote.py did not start (exit {self.proc.wait()})")
        atexit.register(self.stop)
        if not on_first_request:
            self.rank_python = self._write_stand_in(RANK_PYTHON_NAME)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.path:
            folder = os.path.dirname(self.path)
            for leftover in (self.path, os.path.join(folder, SPAWN_PYTHON_NAME), os.path.join(folder, RANK_PYTHON_NAME),
                             folder):
                try:
                    os.rmdir(leftover) if leftover == os.path.dirname(self.path) else os.unlink(leftover)
                except OSError:
                    pass

    def write_spawn_python(self) -> str:
        """A script that runs tests/zygote_python.py with this zygote, for multiprocessing to spawn children with."""
        # The first child waits while the zygote imports (about what the child would have spent importing).
        return self._write_stand_in(SPAWN_PYTHON_NAME, start_timeout_s=900)

    def _write_stand_in(self, name: str, start_timeout_s: float | None = None) -> str:
        """A script beside the socket that runs tests/zygote_python.py with this zygote: a `python` to name."""
        from tests.zygote_python import SOCKET_VAR, START_TIMEOUT_VAR

        script = os.path.join(os.path.dirname(self.path), name)
        timeout = f" {START_TIMEOUT_VAR}={start_timeout_s:g}" if start_timeout_s else ""
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\n{SOCKET_VAR}={shlex.quote(self.path)}{timeout} exec "
                    f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'tests' / 'zygote_python.py'))} \"$@\"\n")
        os.chmod(script, 0o700)
        return script

    def run(self, module: str | None, script: str | None, argv: list[str], env: dict[str, str], timeout: float,
            priority: int) -> subprocess.CompletedProcess:
        request = {"module": module, "script": script, "argv": argv, "env": env, "cwd": str(REPO), "nice": -priority,
                   "spawn_python": spawn_python(env)}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                open(os.devnull, "rb") as stdin, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(self.path)
            conn.settimeout(60)
            try:
                socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()])
                started = conn.recv(4096)
            except ConnectionError:
                started = b""
            if not started:
                raise RuntimeError(f"tests/cli_zygote.py ({self.path}) closed the connection before starting "
                                   f"{_command(module, script, argv)} (its stderr is in the lane's log)")
            if "refused" in json.loads(started):
                raise ZygoteRefused(json.loads(started)["refused"])
            pid = json.loads(started)["pid"]
            conn.settimeout(timeout)
            try:
                reply = conn.recv(4096)
            except socket.timeout:
                _kill_group(pid)
                conn.settimeout(60)
                conn.recv(4096)
                raise subprocess.TimeoutExpired(_command(module, script, argv), timeout,
                                                _read(out), _read(err)) from None
            if not reply:
                raise RuntimeError("tests/cli_zygote.py ended before the run it started (a killed zygote?)")
            code = json.loads(reply)["returncode"]
            return subprocess.CompletedProcess(_command(module, script, argv), code, _read(out), _read(err))


_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote | None] = {}
_ZYGOTES_LOCK = threading.Lock()


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """The zygote that serves requests with this environment (started now if need be), or None: fresh interpreter."""
    if os.environ.get(FRESH_VAR, "") == "1":
        return None
    if env.get("OMP_NUM_THREADS", "1") != "1":
        return None  # OpenMP's threads do not survive a fork (libgomp): one thread per zygote, as in the ranks
    key = import_time_environment(env)
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            if len(_ZYGOTES) >= MAX_ZYGOTES:
                return None
            zygote = Zygote()
            try:
                zygote.start(env)
            except RuntimeError:
                zygote = None  # e.g. a variable its imports refuse: the fresh interpreter shows the command's error
            _ZYGOTES[key] = zygote
        return _ZYGOTES[key]


# The children that multiprocessing spawns in those runs (vLLM's engine core: about 17 of its 20 CPU-seconds go to
# importing torch, transformers and vLLM) fork from a zygote of their own, which imports with the first child's
# environment (tests/cli_zygote.py --on-first-request): one per suite (scripts/run_suite.py starts it for both lanes
# and names its script in SPAWN_PYTHON_VAR), else one per pytest process. A run whose environment sets
# REAL_SPAWN_VAR=1 spawns them as the library does (the tests of which process is whose child).
SPAWN_PYTHON_VAR = "HPC_RLHF_TEST_SPAWN_PYTHON"
REAL_SPAWN_VAR = "HPC_RLHF_TEST_REAL_SPAWN"
SPAWN_PYTHON_NAME = "spawn_python"
RANK_PYTHON_NAME = "rank_python"
_SPAWN_ZYGOTE: list[tuple[Zygote | None, str | None]] = []


def spawn_python(env: dict[str, str]) -> str | None:
    """The script multiprocessing spawns children with in a run of `env`, or None: as the library does."""
    if env.get(REAL_SPAWN_VAR) == "1" or os.environ.get(FRESH_VAR, "") == "1":
        return None
    if os.environ.get(SPAWN_PYTHON_VAR):
        return os.environ[SPAWN_PYTHON_VAR]
    with _ZYGOTES_LOCK:
        if not _SPAWN_ZYGOTE:
            _SPAWN_ZYGOTE.append(start_spawn_zygote())
        return _SPAWN_ZYGOTE[0][1]


def start_spawn_zygote(with_vllm: bool = True) -> tuple[Zygote | None, str | None]:
    """Start the spawned children's zygote (it imports at its first request, vLLM's engine core too unless not
    `with_vllm`): it and the path of its script."""
    zygote = Zygote()
    try:
        zygote.start(worker_env(), on_first_request=True, with_vllm=with_vllm)
    except RuntimeError:
        return None, None
    return zygote, zygote.write_spawn_python()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _command(module: str | None, script: str | None, argv: list[str]) -> list[str]:
    return [sys.executable, *(["-m", module] if module else [script]), *argv]


def run_python(module: str | None, script: str | None, argv: list[str], env: dict[str, str], timeout: float,
               priority: int = 0) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` (or `python SCRIPT ARGV`) from the repository, its output captured as text: forked
    from the zygote of its environment where there is one, else a fresh interpreter."""
    zygote = zygote_for(env)
    if zygote is not None:
        try:
            return zygote.run(module, script, argv, env, timeout, priority)
        except ZygoteRefused:
            pass
    return subprocess.run(_command(module, script, argv), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_raise_priority(priority) if priority else None)
