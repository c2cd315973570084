"""Run a training mode on the world we were given, or start that world on this machine.

Under torchrun, srun or mpirun the mode runs on the world the launcher made, after checking that it has as
many ranks as the configuration needs. Started by hand with no launcher, a mode that needs N > 1 ranks
starts N copies of itself here with torchrun's variables (`spawn_local`), so `hpc-rlhf ppo --config ...`
works on a laptop exactly as it does under Slurm.

With a CPU-only torch the copies are forked from the launcher, which has already imported torch, transformers
and the mode: a fresh interpreter per rank would import them again (about 4 CPU-seconds each, most of a short
job's time when several ranks share a few cores). With a CUDA (or ROCm) build every rank is a fresh interpreter:
a process must not fork once anything in it may have initialised the CUDA driver. HPC_RLHF_LOCAL_FORK=0 turns
forking off.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hpc_rlhf.config import ConfigError
from hpc_rlhf.data.loading import DataError
from hpc_rlhf.dist import liveness, store_guard, watchdog
from hpc_rlhf.dist.bootstrap import free_port, init_distributed, shutdown
from hpc_rlhf.dist.launch_env import LOOPBACK, BootstrapError, detect_launch
from hpc_rlhf.dist.liveness import ERROR_FILE_VAR
from hpc_rlhf.dist.placement import PlacementError
from hpc_rlhf.rewards import RewardFunctionError
from hpc_rlhf.utils import console

PREEMPTED_EXIT_CODE = 75  # hpc_rlhf.runtime.checkpointing.Preempted: checkpoint written, requeue me

LOCAL_LAUNCH_FLAG = "HPC_RLHF_LOCAL_LAUNCH"
FORK_VAR = "HPC_RLHF_LOCAL_FORK"  # 0: start every local rank as a fresh interpreter, even with a CPU-only torch
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Errors that describe bad input rather than a bug: shown as one line, exit code 2, no traceback.
USER_ERRORS = (ConfigError, BootstrapError, ValueError)
# Bad input found while a run sets up (data rows, placements, reward functions): one line, exit code 2 too.
RUN_INPUT_ERRORS = (ConfigError, BootstrapError, DataError, PlacementError, RewardFunctionError)


def ranks_needed(cfg: Any) -> int:
    """`cfg.world_size()` when the mode's placement defines it, else `cfg.dist.nproc`."""
    world_size = getattr(cfg, "world_size", None)
    return int(world_size()) if callable(world_size) else int(cfg.dist.nproc)


def child_command(mode: str, argv: Sequence[str]) -> list[str]:
    """The command each local rank runs: this same program, mode and arguments."""
    return [sys.executable, "-m", "hpc_rlhf", mode, *argv]


def run_or_spawn(mode: str, cfg: Any, run_fn: Callable[[Any], Any], argv: list[str]) -> int:
    """Run `run_fn(cfg)` on this rank of the job's world, or start the world locally; return an exit code."""
    try:
        needed = ranks_needed(cfg)
        launch = detect_launch()
    except USER_ERRORS as exc:
        print(f"hpc-rlhf {mode}: {exc}", file=sys.stderr)
        return 2
    if launch.launcher == "single" and needed > 1:
        if os.environ.get(LOCAL_LAUNCH_FLAG):
            # A child of the local launcher that lost its RANK variables would otherwise start N more ranks.
            print(f"hpc-rlhf {mode}: started by the local launcher ({LOCAL_LAUNCH_FLAG} is set) but RANK and "
                  f"WORLD_SIZE are missing; refusing to start {needed} more ranks", file=sys.stderr)
            return 2
        try:
            forked = can_fork_ranks()
        except ConfigError as exc:
            print(f"hpc-rlhf {mode}: {exc}", file=sys.stderr)
            return 2
        print(f"hpc-rlhf {mode}: no launcher found; starting {needed} ranks on this machine"
              f"{' (forked from this process)' if forked else ''}", file=sys.stderr)
        target = None
        if forked:
            import_what_ranks_use()
            target = functools.partial(_run_on_this_rank, mode, cfg, run_fn, needed)
        return spawn_local(needed, child_command(mode, argv), target=target)
    return _run_on_this_rank(mode, cfg, run_fn, needed)


def import_what_ranks_use() -> None:
    """Imported once here, shared by every forked rank: the model classes every rank loads, deepspeed (which
    each training rank would otherwise import for itself, ~2 CPU-seconds each) and datasets (every rank reads its
    data through it: 0.3 CPU-seconds each). Only a saving: what fails to import here fails again, with the rank's
    own message, where a rank needs it."""
    try:
        # Heavy (transformers, deepspeed, datasets) and only worth it when ranks are forked: imported here, on purpose.
        import datasets  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer  # noqa: F401

        from hpc_rlhf.engines.deepspeed_compat import import_deepspeed

        import_deepspeed()
        # Which of DeepSpeed's ops this machine can load, probed by every process that starts DeepSpeed's
        # communication (compiling and linking a test program for the async I/O op on the way): once, here,
        # instead of 0.15 s in each rank.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__  # noqa: B018  (computed and kept by the module on first access)
        # DeepSpeed imports its Muon optimizer at every ZeRO engine's start, and that module calls torch.compile
        # when imported, which imports torch's compiler stack: 1.5 CPU-seconds in each training rank (a quarter of
        # a 6-rank PPO run's CPU, 2026-11-29). It starts no thread or process.
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass


def can_fork_ranks() -> bool:
    """Whether local ranks may be forked from this process: Linux, a torch without CUDA or ROCm, and not
    turned off with HPC_RLHF_LOCAL_FORK=0 (see the module docstring)."""
    wanted = os.environ.get(FORK_VAR, "1").strip().lower()
    if wanted not in ("1", "0", "true", "false", "yes", "no", "on", "off", ""):
        raise ConfigError(f"{FORK_VAR}={os.environ[FORK_VAR]!r}: give 0 (ranks as fresh interpreters) or 1 (fork "
                          f"them where torch has no CUDA)")
    if not sys.platform.startswith("linux") or wanted in ("0", "false", "no", "off"):
        return False
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _run_on_this_rank(mode: str, cfg: Any, run_fn: Callable[[Any], Any], needed: int) -> int:
    try:
        launch = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, expected_world_size=needed)
    except USER_ERRORS as exc:
        liveness.record_failure(str(exc))
        print(f"hpc-rlhf {mode}: {exc}", file=sys.stderr)
        return 2
    try:
        run_fn(cfg)
        # No barrier: the store (rank 0's store process, or torchrun's agent) outlives every rank, and a barrier
        # after the watchdog has stopped would wait for a rank that dies now until dist.timeout_s.
        watchdog.stop()
        return 0
    except SystemExit as exc:
        if exc.code != PREEMPTED_EXIT_CODE:
            console.close_progress_bars()  # its message (a text code) is printed next: on a line of its own
            raise
        # Checkpoint written: leave with the requeue code. srun --kill-on-bad-exit SIGTERMs the other ranks
        # as soon as one exits, and a stop signal may reach this node late; a rank still tearing down must not
        # die of either (srun would report 143 or 138, not 75). See launch.slurm.run_rank.
        watchdog.stop()
        for late in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(late, signal.SIG_IGN)
        return PREEMPTED_EXIT_CODE
    except RUN_INPUT_ERRORS as exc:
        liveness.record_failure(str(exc))
        watchdog.report_failure(exc)  # failure handling: tell the other ranks at once
        console.say(f"rank {launch.rank}: {exc}")
        return 2
    except Exception as exc:  # noqa: BLE001 - any failure of a rank ends that rank with a message
        liveness.record_failure(f"{type(exc).__name__}: {exc}")
        watchdog.report_failure(exc)  # failure handling: tell the other ranks at once
        console.close_progress_bars()  # the traceback starts a line of its own
        traceback.print_exc()
        console.say(f"rank {launch.rank}: {type(exc).__name__}: {exc}")
        return 1
    finally:
        _forget_groups()
        shutdown()


def _forget_groups() -> None:
    """Destroy the run's process groups (dist.groups) if it made any: no rank process needs it, as it ends
    anyway, but a run in a process that goes on (a test, an interactive session) leaves the groups' plan behind
    otherwise, and the next run there refuses to initialise them again."""
    groups = sys.modules.get("hpc_rlhf.dist.groups")  # loaded by the run if it made groups; never imported here
    if groups is not None and groups.is_initialized():
        groups.destroy()


# ------------------------------------------------------------------------------------------- local launcher
def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that makes a child die with the launcher (Linux), so that no rank outlives a kill -9."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: nothing may be loaded after fork
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL))

    return hook


class _ForkedRank:
    """A rank forked from the launcher, with the part of subprocess.Popen's interface that spawn_local uses
    (returncode: the exit code, or minus the number of the signal that ended it)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


# Forked ranks share the heap of the process they were forked from. A collection of the oldest generation walks every
# object the launcher had (torch, transformers, deepspeed: ~430,000 of them, 0.35-0.45 CPU-s a walk) and writes to
# each object's header, so every rank also copies the pages the walk touched. Before the forks the launcher moves its
# objects out of the collector's reach (`gc.freeze`), so the ranks' collections walk only their own objects; when the
# ranks have ended it takes them back, so that its own end runs as before (frozen objects are never freed, and an
# extension such as triton's then reports them as leaked at exit). A 6-rank PPO run of the tiny model (ZeRO-3, 3
# steps): 48 -> ~41 CPU-s (2026-11-29, AMD EPYC 2-core VM; docs/results.md). The cost this removes is the
# collector's, not the rank's work: nothing a rank computes changes.


def _fork_rank(env: Mapping[str, str], target: Callable[[], int], handlers: Mapping[int, Any],
               die_with_launcher: Callable[[], None] | None) -> _ForkedRank:
    """Fork a rank that runs `target()` with environment `env` and exits with its code; it never returns into
    the launcher's code. `handlers`: the signal handlers this process had before the launcher's forwarding."""
    launcher = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _ForkedRank(pid)
    code = 1
    try:
        os.setsid()  # as start_new_session: a terminal's Ctrl-C reaches the launcher only
        if die_with_launcher is not None:
            die_with_launcher()
            if os.getppid() != launcher:  # it died before the hook was set
                os._exit(1)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(env)
        _use_thread_count(env)
        atexit._clear()  # the launcher's exit handlers are not this rank's
        try:
            code = int(target())
        except SystemExit as exc:  # as an interpreter ends on sys.exit(...)
            if exc.code is not None and not isinstance(exc.code, int):
                console.say(str(exc.code))
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - KeyboardInterrupt and the like: as an interpreter ends on them
            console.close_progress_bars()
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # this rank's own (the watchdog's stop, ...), as at any interpreter's end
    except BaseException:  # noqa: BLE001 - whatever happens, the fork must never return into the launcher
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _use_thread_count(env: Mapping[str, str]) -> None:
    """torch read OMP_NUM_THREADS when the launcher imported it; a forked rank takes its own value."""
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"failed with exit code {code}"


def _kill_group(proc: Any, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its own process group: this reaches its helpers too
    except (ProcessLookupError, PermissionError):
        pass


def spawn_local(nproc: int, cmd: Sequence[str], env: Mapping[str, str] | None = None, *,
                target: Callable[[], int] | None = None, grace_s: float = 5.0, poll_s: float = 0.05) -> int:
    """Run `cmd` as ranks 0..nproc-1 of a local world (torchrun's variables) and wait for all of them.

    `env` is the ranks' environment (default: this process's), to which the launch variables are added. With
    `target`, each rank is instead a fork of this process that runs `target()` in that environment and exits
    with the code it returns.

    SIGINT, SIGTERM and SIGUSR1 sent to the launcher are passed to every rank. When a rank fails, the others
    get `grace_s` seconds to stop on their own (they usually notice the lost peer), then they are killed.
    Returns 0, or the first failed rank's exit code (128 + signal number for a signal), after one line on
    stderr naming that rank.
    """
    if nproc < 1:
        raise ValueError(f"spawn_local: nproc must be at least 1, got {nproc}")
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    # Variables of an outer torchrun would make rank 0 wait for a store server that is not ours.
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if store_guard.secret_from_env(base) is None:
        base[store_guard.SECRET_VAR] = store_guard.make_secret()
    port = free_port(LOOPBACK)
    pre_exec = _parent_death_signal()
    procs: list[Any] = []  # subprocess.Popen or _ForkedRank

    def forward(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc, signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS} if in_main_thread else {}
    failures: dict[int, tuple[float, int]] = {}  # rank -> (time its exit was seen, exit code)
    killed: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="hpc_rlhf_ranks_") as error_dir:
        error_files = [Path(error_dir) / f"rank{rank}.json" for rank in range(nproc)]
        # The ranks' collections skip what they inherit (above _fork_rank); a caller that froze its own objects (the
        # tests' zygote) keeps them frozen.
        freezing = target is not None and gc.get_freeze_count() == 0
        try:
            if freezing:
                gc.freeze()
            for rank in range(nproc):
                child_env = dict(base, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                                 LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                                 MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
                                 **{LOCAL_LAUNCH_FLAG: "1", ERROR_FILE_VAR: str(error_files[rank])})
                if target is not None:
                    procs.append(_fork_rank(child_env, target, previous, pre_exec))
                    continue
                # A session of its own: a terminal's Ctrl-C reaches the launcher only, which forwards it once.
                procs.append(subprocess.Popen(list(cmd), env=child_env, start_new_session=True,
                                              preexec_fn=pre_exec))
            deadline = None
            while True:
                codes = [proc.poll() for proc in procs]
                for rank, code in enumerate(codes):
                    if code not in (None, 0) and rank not in failures:
                        failures[rank] = (time.time(), code)
                        deadline = deadline or time.monotonic() + grace_s
                if all(code is not None for code in codes):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    for rank, proc in enumerate(procs):
                        if proc.poll() is None:
                            _kill_group(proc, signal.SIGKILL)
                            killed.add(rank)
                    for proc in procs:
                        proc.wait()
                    break
                time.sleep(poll_s)
        finally:
            for proc in procs:  # only reached with live ranks if the launcher itself failed
                if proc.poll() is None:
                    _kill_group(proc, signal.SIGKILL)
                    proc.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if freezing:
                gc.unfreeze()
        records = {rank: liveness.read_recorded_failure(error_files[rank]) for rank in failures}

    if not failures:
        return 0
    # The first failure is the earliest recorded one; a rank that recorded nothing failed when its exit was seen.
    rank = min(failures, key=lambda r: (records[r] or failures[r])[0])
    code = failures[rank][1]
    because = f": {' '.join(records[rank][1].split())[:300]}" if records[rank] else ""
    stopped = f"; killed {len(killed)} rank(s) still running after {grace_s:g} s" if killed else ""
    console.say(f"hpc-rlhf: rank {rank} of {nproc} {_describe_exit(code)} (first rank to fail){because}{stopped}")
    return code if code > 0 else 128 + (-code)
