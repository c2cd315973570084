import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hpc_rlhf.config import ConfigError, DistSection
from hpc_rlhf.dist import liveness
from hpc_rlhf.launch import local
from hpc_rlhf.launch.local import run_or_spawn, spawn_local

THIS = str(Path(__file__).resolve())


@dataclass
class FakeConfig:
    dist: DistSection = field(default_factory=DistSection)


@dataclass
class PlacedConfig(FakeConfig):
    """A config whose placement decides the world size, as PPO-style modes do."""
    ranks: int = 3

    def world_size(self) -> int:
        if self.ranks < 1:
            raise ConfigError("placement 'actor=0' gives no ranks")
        return self.ranks


def env_for_children(**extra):
    from tests.distributed import worker_env

    env = worker_env()
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """True for a running process; a zombie (dead, not yet reaped by its new parent) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def read_json_files(folder: Path, pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(pattern))]


# ------------------------------------------------------------------------------------------------ spawn_local
@pytest.fixture(params=["exec", "fork"])
def start(request):
    """spawn_local(N, CASE, FOLDER) as a fresh interpreter per rank ('exec') or as forks of this process that run
    rank_case ('fork': what run_or_spawn does with a CPU-only torch)."""
    def spawn(nproc: int, case: str, folder: Path, env=None, **kwargs) -> int:
        target = functools.partial(rank_case, case, folder) if request.param == "fork" else None
        return spawn_local(nproc, [sys.executable, THIS, case, str(folder)], env=env or env_for_children(),
                           target=target, **kwargs)

    spawn.forked = request.param == "fork"
    return spawn


def test_spawned_ranks_see_their_own_torchrun_variables(tmp_path, start):
    assert start(3, "env", tmp_path) == 0
    seen = read_json_files(tmp_path, "rank*.json")
    assert [s["RANK"] for s in seen] == ["0", "1", "2"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1", "2"]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"} and {s["LOCAL_WORLD_SIZE"] for s in seen} == {"3"}
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert {s["OMP_NUM_THREADS"] for s in seen} == {"1"}  # set because the parent environment had none
    assert {s["HPC_RLHF_LOCAL_LAUNCH"] for s in seen} == {"1"}
    assert [s["detected"] for s in seen] == [["torchrun", r, 3] for r in range(3)]
    if start.forked:  # torch was imported before the fork: the rank's own thread count is applied
        assert {s["torch_threads"] for s in seen} == {1}


def test_an_explicit_thread_count_is_kept(tmp_path, start):
    assert start(1, "env", tmp_path, env=env_for_children(OMP_NUM_THREADS="3")) == 0
    seen = read_json_files(tmp_path, "rank*.json")[0]
    assert seen["OMP_NUM_THREADS"] == "3"
    if start.forked:
        assert seen["torch_threads"] == 3


def test_a_failing_rank_stops_the_job_and_is_named(tmp_path, capfd, start):
    began = time.monotonic()
    code = start(3, "fail", tmp_path, grace_s=1.0)
    elapsed = time.monotonic() - began
    assert code == 3
    err = capfd.readouterr().err
    assert "hpc-rlhf: rank 1 of 3 failed with exit code 3" in err
    assert "killed 2 rank(s)" in err
    assert elapsed < 30  # the siblings sleep 120 s: they were killed, not waited for
    pids = [int(p.read_text()) for p in tmp_path.glob("sleeper*.pid")]
    assert len(pids) == 2
    assert not any(alive(pid) for pid in pids)


def test_a_rank_killed_by_a_signal_is_reported_as_such(tmp_path, capfd, start):
    assert start(2, "segv", tmp_path, grace_s=1.0) == 128 + signal.SIGSEGV
    assert "rank 0 of 2 was killed by signal SIGSEGV" in capfd.readouterr().err


def test_the_earliest_recorded_failure_is_named_not_the_first_exit(tmp_path, capfd, start):
    # Rank 1 fails first but takes a while to exit; rank 0 then fails because of it and exits at once.
    assert start(2, "slow-exit", tmp_path, grace_s=10.0) == 5
    assert "hpc-rlhf: rank 1 of 2 failed with exit code 5 (first rank to fail): RuntimeError: lost the data" \
        in capfd.readouterr().err


def test_ranks_are_forked_only_from_a_torch_without_cuda_and_unless_turned_off(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(local.FORK_VAR, raising=False)
    assert local.can_fork_ranks() is sys.platform.startswith("linux")
    monkeypatch.setenv(local.FORK_VAR, "0")
    assert local.can_fork_ranks() is False
    monkeypatch.setenv(local.FORK_VAR, "off")
    assert local.can_fork_ranks() is False
    monkeypatch.delenv(local.FORK_VAR)
    # Something may have started the CUDA driver in the launcher (torch.cuda.is_available() does): a fork would
    # inherit it half-made, so a CUDA or ROCm build starts fresh interpreters.
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert local.can_fork_ranks() is False
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert local.can_fork_ranks() is False


def test_a_fork_setting_that_means_nothing_is_named_before_any_rank_starts(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "HPC_RLHF_LOCAL_LAUNCH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(local.FORK_VAR, "maybe")
    monkeypatch.setattr(local, "spawn_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    assert run_or_spawn("ppo", PlacedConfig(ranks=2), lambda cfg: None, []) == 2
    assert "HPC_RLHF_LOCAL_FORK='maybe': give 0" in capsys.readouterr().err


def test_a_forked_rank_runs_its_own_exit_handlers_not_the_launchers(tmp_path):
    import atexit

    def launcher_handler():
        (tmp_path / f"launcher-handler-ran-in-{os.getpid()}").write_text("!")

    def rank_with_handler() -> int:
        atexit.register(lambda: (tmp_path / f"rank{os.environ['RANK']}-handler").write_text("ran"))
        return 0

    atexit.register(launcher_handler)
    try:
        assert spawn_local(2, ["unused"], env=env_for_children(), target=rank_with_handler) == 0
    finally:
        atexit.unregister(launcher_handler)  # nor at the end of this pytest process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-handler", "rank1-handler"]


def test_forked_ranks_find_what_they_inherit_frozen_and_the_launcher_gets_it_back(tmp_path):
    """Before the forks the launcher moves its objects out of the garbage collector's reach, so that the ranks'
    collections skip them (hpc_rlhf/launch/local.py says why); when the ranks have ended it takes them back, and leaves
    a caller's own freeze alone."""
    import gc

    def rank_reports_its_frozen_objects() -> int:
        (tmp_path / f"rank{os.environ['RANK']}").write_text(str(gc.get_freeze_count()))
        return 0

    before = gc.get_freeze_count()
    assert spawn_local(2, ["unused"], env=env_for_children(), target=rank_reports_its_frozen_objects) == 0
    assert gc.get_freeze_count() == before
    assert all(int((tmp_path / f"rank{r}").read_text()) > before + 10_000 for r in range(2))

    # A caller that froze its own objects (the tests' zygote does) finds them still frozen afterwards.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert spawn_local(2, ["unused"], env=env_for_children(), target=rank_reports_its_frozen_objects) == 0
        # Still frozen: unfreezing would leave 0. A frozen object whose last reference went away during the runs
        # is freed and leaves the count (3 of ~514,000 did in a fresh-clone suite), so the count may only fall a little.
        assert frozen - 1_000 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_the_launcher_imports_the_module_each_zero_engine_start_imports():
    """DeepSpeed imports its Muon optimizer at every ZeRO engine's start (and with it torch's compiler stack);
    imported before the forks, the ranks share it."""
    from hpc_rlhf.launch.local import import_what_ranks_use

    import_what_ranks_use()
    assert "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules


def test_the_launcher_probes_deepspeeds_ops_once_for_its_forked_ranks(monkeypatch):
    """Which ops DeepSpeed can load (its communication asks at every start, and the probe compiles and links a test
    program): found before the forks, the ranks inherit the answer."""
    import deepspeed.ops

    from hpc_rlhf.launch.local import import_what_ranks_use

    monkeypatch.delitem(vars(deepspeed.ops), "__compatible_ops__", raising=False)  # as in a fresh interpreter
    import_what_ranks_use()
    assert vars(deepspeed.ops)["__compatible_ops__"]["deepspeed_shm_comm"] is True


@pytest.fixture(params=["exec", "fork"])
def trapping_launcher(request, tmp_path):
    """A launcher (in its own process) of 2 ranks, started either way, that wait for SIGUSR1; returns it and
    the ranks' pids."""
    case = "launcher-trap-fork" if request.param == "fork" else "launcher-trap"
    return start_trapping_launcher(tmp_path, case)


def start_trapping_launcher(folder: Path, case: str) -> tuple[subprocess.Popen, list[int]]:
    launcher = subprocess.Popen([sys.executable, THIS, case, str(folder)], env=env_for_children())
    deadline = time.monotonic() + 60
    while len(list(folder.glob("ready*"))) < 2:
        assert time.monotonic() < deadline, "ranks did not start"
        assert launcher.poll() is None, "launcher ended early"
        time.sleep(0.05)
    return launcher, [int(p.read_text()) for p in folder.glob("ready*")]


def test_signals_to_the_launcher_reach_every_rank(tmp_path, trapping_launcher):
    launcher, _ = trapping_launcher
    try:
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(timeout=30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    got = sorted(p.read_text() for p in tmp_path.glob("got*"))
    assert got == ["rank 0 got SIGUSR1", "rank 1 got SIGUSR1"]


def test_ranks_die_with_a_killed_launcher(tmp_path, trapping_launcher):
    launcher, pids = trapping_launcher
    launcher.kill()  # SIGKILL: the launcher cannot clean up, the kernel must
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    try:
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "ranks outlived their launcher"
            time.sleep(0.05)
    finally:
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------- run_or_spawn
def test_no_launcher_and_one_rank_runs_here_on_a_one_rank_world(monkeypatch):
    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(key, raising=False)
    seen = {}

    def run(cfg):
        seen.update(world=dist.get_world_size(), backend=dist.get_backend(), cfg=cfg)

    cfg = FakeConfig()
    assert run_or_spawn("sft", cfg, run, []) == 0
    assert seen == dict(world=1, backend="gloo", cfg=cfg)
    assert not dist.is_initialized()  # shut down afterwards


def test_a_failing_run_prints_rank_error_and_traceback(monkeypatch, capfd):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(cfg):
        raise RuntimeError("boom")

    assert run_or_spawn("sft", FakeConfig(), run, []) == 1
    err = capfd.readouterr().err  # the rank's line is one write(2) to fd 2 (utils/console.py)
    assert "Traceback" in err and err.rstrip().endswith("rank 0: RuntimeError: boom")


def test_a_preempted_run_returns_75_and_ignores_late_stop_signals(monkeypatch):
    from hpc_rlhf.runtime.checkpointing import Preempted

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def run(cfg):
        raise Preempted(step=3)

    try:
        assert run_or_spawn("sft", FakeConfig(), run, []) == 75
        # The checkpoint is written; Python puts default actions back while it shuts down, so a late SIGUSR1 or
        # srun's SIGTERM would otherwise end the rank with 138 or 143 instead of 75.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_config_error_during_the_run_is_one_line_and_code_2(monkeypatch, capfd):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(cfg):
        raise ConfigError("data/train.jsonl row 7: key 'prompt' is missing")

    assert run_or_spawn("sft", FakeConfig(), run, []) == 2
    err = capfd.readouterr().err
    assert err.strip() == "rank 0: data/train.jsonl row 7: key 'prompt' is missing"


def test_an_invalid_placement_is_reported_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(local, "spawn_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    assert run_or_spawn("ppo", PlacedConfig(ranks=0), lambda cfg: None, []) == 2
    assert capsys.readouterr().err.strip() == "hpc-rlhf ppo: placement 'actor=0' gives no ranks"


def test_a_bad_launch_environment_is_code_2(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert run_or_spawn("sft", FakeConfig(), lambda cfg: None, []) == 2
    assert "WORLD_SIZE='2' is set but RANK is not" in capsys.readouterr().err


def test_several_ranks_without_launcher_respawn_this_program(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "HPC_RLHF_LOCAL_LAUNCH"):
        monkeypatch.delenv(key, raising=False)
    calls = []
    monkeypatch.setenv(local.FORK_VAR, "0")
    monkeypatch.setattr(local, "spawn_local",
                        lambda nproc, cmd, env=None, target=None: calls.append((nproc, cmd, target)) or 0)
    argv = ["--config", "examples/tiny/ppo.yaml", "train.lr=1e-4"]
    assert run_or_spawn("ppo", PlacedConfig(ranks=3), lambda cfg: None, argv) == 0
    assert calls == [(3, [sys.executable, "-m", "hpc_rlhf", "ppo", *argv], None)]
    # Allowed to fork (a CPU-only torch): the same command, and the ranks run this rank's part of the mode.
    monkeypatch.setattr(local, "can_fork_ranks", lambda: True)
    assert run_or_spawn("ppo", PlacedConfig(ranks=3), lambda cfg: None, argv) == 0
    target = calls[-1][2]
    assert calls[-1][:2] == calls[0][:2] and target.func is local._run_on_this_rank
    assert target.args[0] == "ppo" and target.args[3] == 3


def test_nproc_decides_when_there_is_no_placement(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "HPC_RLHF_LOCAL_LAUNCH"):
        monkeypatch.delenv(key, raising=False)
    calls = []
    monkeypatch.setattr(local, "spawn_local", lambda nproc, cmd, env=None, target=None: calls.append(nproc) or 0)
    cfg = FakeConfig()
    cfg.dist.nproc = 4
    assert run_or_spawn("dpo", cfg, lambda cfg: None, []) == 0
    assert calls == [4]


def test_a_child_without_rank_variables_does_not_spawn_again(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("HPC_RLHF_LOCAL_LAUNCH", "1")
    monkeypatch.setattr(local, "spawn_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    assert run_or_spawn("ppo", PlacedConfig(ranks=2), lambda cfg: None, []) == 2
    assert "refusing to start 2 more ranks" in capsys.readouterr().err


def test_local_world_end_to_end(monkeypatch, tmp_path, capfd):
    """run_or_spawn starts 2 ranks, each finds the launcher's variables, joins the world and all-reduces; then
    rank 1 raises, and the launcher names it and exits 1."""
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "HPC_RLHF_LOCAL_LAUNCH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTHONPATH", env_for_children()["PYTHONPATH"])
    monkeypatch.setenv(local.FORK_VAR, "0")  # fresh interpreters; forked ranks: the next test
    monkeypatch.setattr(local, "child_command",
                        lambda mode, argv: [sys.executable, THIS, "mode-child", str(tmp_path), *argv])
    cfg = FakeConfig()
    cfg.dist.nproc = 2
    assert run_or_spawn("fake", cfg, lambda cfg: None, ["fail-rank=1"]) == 1
    err = capfd.readouterr().err
    assert "rank 1: RuntimeError: rank 1 was told to fail" in err
    assert "hpc-rlhf: rank 1 of 2 failed with exit code 1" in err
    assert read_json_files(tmp_path, "result*.json") == [{"rank": 0, "world": 2, "sum": 3.0},
                                                         {"rank": 1, "world": 2, "sum": 3.0}]


def test_local_world_end_to_end_with_forked_ranks(tmp_path):
    """The same from a process of its own (as `hpc-rlhf MODE` runs): with a CPU-only torch the launcher forks
    the ranks, which join the world and all-reduce, and the one that then fails is named. (A run whose ranks all
    succeed exits 0: every test of `hpc-rlhf MODE` on local ranks.)"""
    import torch

    from tests.distributed import run_python, worker_env

    if not local.can_fork_ranks():
        pytest.skip(f"this torch ({torch.__version__}) has CUDA or ROCm: local ranks are fresh interpreters")
    # Forked from the tests' zygote (the environment of the suite's other command lines), as a fresh one would run.
    failed = run_python(None, THIS, ["mode-child", str(tmp_path), "fail-rank=1"], env=worker_env(), timeout=120)
    assert failed.returncode == 1, failed.stderr
    assert "starting 2 ranks on this machine (forked from this process)" in failed.stderr
    assert "rank 1: RuntimeError: rank 1 was told to fail" in failed.stderr
    assert "hpc-rlhf: rank 1 of 2 failed with exit code 1" in failed.stderr
    assert read_json_files(tmp_path, "result*.json") == [{"rank": 0, "world": 2, "sum": 3.0},
                                                         {"rank": 1, "world": 2, "sum": 3.0}]


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)


def rank_case(case: str, folder: Path) -> int:
    """One rank's part of a test (started as `python THIS CASE FOLDER ...`, or forked with `target=`)."""
    rank = int(os.environ.get("RANK", "0"))
    if case == "env":
        from hpc_rlhf.dist.bootstrap import detect_launch

        info = detect_launch()
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "OMP_NUM_THREADS", "HPC_RLHF_LOCAL_LAUNCH")
        seen = {k: os.environ.get(k) for k in keys}
        seen["detected"] = [info.launcher, info.rank, info.world_size]
        seen["torch_threads"] = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
        (folder / f"rank{rank}.json").write_text(json.dumps(seen))
    elif case == "fail":
        if rank == 1:
            wait_for(lambda: len(list(folder.glob("sleeper*.pid"))) == 2)
            sys.exit(3)
        (folder / f".sleeper{rank}").write_text(str(os.getpid()))
        os.replace(folder / f".sleeper{rank}", folder / f"sleeper{rank}.pid")
        time.sleep(120)
    elif case == "segv":
        if rank == 0:
            import faulthandler

            faulthandler.disable()  # a fork of pytest would print pytest's stack: noise in the test's output
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(120)
    elif case == "slow-exit":
        if rank == 1:
            liveness.record_failure("RuntimeError: lost the data")
            time.sleep(1.5)
            sys.exit(5)
        # Rank 0 exits as soon as rank 1 has recorded its failure, so it is the first to exit.
        wait_for(Path(os.environ[liveness.ERROR_FILE_VAR]).with_name("rank1.json").exists)
        sys.exit(7)
    elif case in ("launcher-trap", "launcher-trap-fork"):
        target = functools.partial(rank_case, "trap", folder) if case.endswith("fork") else None
        sys.exit(spawn_local(2, [sys.executable, THIS, "trap", str(folder)], grace_s=1.0, target=target))
    elif case == "trap":
        def on_signal(signum, _frame):
            (folder / f"got{rank}").write_text(f"rank {rank} got {signal.Signals(signum).name}")
            sys.exit(0)

        signal.signal(signal.SIGUSR1, on_signal)
        (folder / f".ready{rank}").write_text(str(os.getpid()))
        os.replace(folder / f".ready{rank}", folder / f"ready{rank}")  # the test never sees a half-written file
        time.sleep(60)
        sys.exit(1)  # the signal never came
    elif case == "mode-child":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fail_rank = sys.argv[3].split("=", 1)[1]

        def run(cfg):
            total = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(total)
            result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item()}
            (folder / f"result{dist.get_rank()}.json").write_text(json.dumps(result))
            if str(dist.get_rank()) == fail_rank:
                raise RuntimeError(f"rank {dist.get_rank()} was told to fail")

        cfg = FakeConfig()
        cfg.dist.nproc = 2
        cfg.dist.timeout_s = 60
        return run_or_spawn("fake", cfg, run, sys.argv[3:])
    return 0


if __name__ == "__main__":
    sys.exit(rank_case(sys.argv[1], Path(sys.argv[2])))
