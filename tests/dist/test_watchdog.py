"""The watchdog: pure helpers, several ranks' watchdogs on one real TCPStore in this process, and whole local
worlds (torchrun's agent store; the local launcher, where rank 0 hosts the store) that lose a rank."""

import collections
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from hpc_rlhf.dist import liveness, progress, watchdog
from hpc_rlhf.dist.bootstrap import store_host_rank
from hpc_rlhf.dist.liveness import STOPPED
from hpc_rlhf.dist.failures import is_consequence, process_alive, watched_ranks
from hpc_rlhf.dist.progress import Progress
from hpc_rlhf.dist.watchdog import Watchdog
from hpc_rlhf.utils.faults import FAULT_ENV, InjectedFault

TIMEOUT = 0.5     # heartbeat timeout of the in-process watchdogs
INTERVAL = 0.05


# ============================================================================================= pure helpers
def test_watched_ranks_are_ring_successors_plus_the_store_host():
    assert watched_ranks(0, 4, 0) == [1, 2, 3]
    assert watched_ranks(2, 4, 0) == [3, 0, 1]
    assert watched_ranks(5, 20, 0) == [6, 7, 8, 9, 10, 11, 12, 13, 0]
    assert watched_ranks(5, 20, None) == [6, 7, 8, 9, 10, 11, 12, 13]
    assert watched_ranks(0, 1, 0) == []


def test_every_rank_is_watched_by_eight_others_in_a_large_world():
    world = 50
    watchers = {r: 0 for r in range(world)}
    for rank in range(world):
        for peer in watched_ranks(rank, world, None):
            watchers[peer] += 1
    assert set(watchers.values()) == {8}


def test_communication_errors_are_consequences_other_errors_are_causes():
    assert is_consequence(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"))
    assert is_consequence(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    wrapped = ValueError("step failed")
    wrapped.__cause__ = RuntimeError("Connection reset by peer")
    assert is_consequence(wrapped)
    assert not is_consequence(InjectedFault("injected fault"))
    assert not is_consequence(FloatingPointError("3 optimizer steps in a row had a non-finite loss"))


def test_process_alive_sees_a_reaped_and_a_zombie_process():
    assert process_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # not reaped yet: a zombie once it has exited
        with open(f"/proc/{proc.pid}/stat") as handle:
            if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    assert not process_alive(proc.pid)
    proc.wait()
    assert not process_alive(proc.pid)


def test_phases_nest_and_a_failure_keeps_its_phase():
    state = Progress()
    with progress._Phase(state, "training"):
        assert state.name == "training"
        with progress._Phase(state, "exchange"):
            assert state.name == "exchange"
        assert state.name == "training"
    assert state.name == "training"  # stays until the next phase starts
    with pytest.raises(KeyError):
        with progress._Phase(state, "scoring"):
            raise KeyError("x")
    assert state.name == "scoring" and state.stack == []


def test_phase_runs_the_fault_point_with_the_step(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kind=raise,phase=scoring,step=4")
    monkeypatch.setenv("RANK", "0")
    watchdog.set_step(3)
    with watchdog.phase("scoring"):
        pass
    watchdog.set_step(4)
    with pytest.raises(InjectedFault, match="phase scoring, step 4"):
        with watchdog.phase("scoring"):
            pass
    assert watchdog.current_phase() == "scoring" and watchdog.current_step() == 4


# Everything entering and leaving a phase may call: its own bookkeeping, the fault check (one environment lookup)
# and list operations: 21 calls (6.5 us on a quiet 2-core VM). A clock, a lock, a log line or a store write
# per phase would show here, whatever the machine's load (a wall-clock bound of this test failed beside the suite).
PHASE_PYTHON_FILES = {"progress.py", "faults.py", "<frozen os>", "<frozen _collections_abc>"}
PHASE_BUILTINS = {"isinstance", "list.append", "list.pop", "str.encode"}
MAX_CALLS_PER_PHASE = 25


def test_a_phase_only_keeps_its_books_and_checks_for_faults(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    python_calls, builtin_calls = collections.Counter(), collections.Counter()

    def record(frame, event, arg):
        if event == "call":
            python_calls[os.path.basename(frame.f_code.co_filename)] += 1
        elif event == "c_call":
            builtin_calls[arg.__qualname__] += 1

    # The collector stays off meanwhile: its callbacks (gc.callbacks, another library's: hypothesis) are Python
    # calls too, and one collection fell inside the loop in a suite run.
    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(record)
    try:
        for step in range(100):
            watchdog.set_step(step)
            with watchdog.phase("training"):
                pass
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    builtin_calls.pop("setprofile", None)
    assert set(python_calls) <= PHASE_PYTHON_FILES, python_calls
    assert set(builtin_calls) <= PHASE_BUILTINS, builtin_calls
    assert python_calls["progress.py"] == 500  # set_step, phase, __init__, __enter__, __exit__: each once a phase
    assert sum(python_calls.values()) + sum(builtin_calls.values()) <= 100 * MAX_CALLS_PER_PHASE


def test_timeout_comes_from_the_environment_then_the_config(monkeypatch):
    class Dist:
        heartbeat_timeout_s = 12.0

    class Cfg:
        dist = Dist()

    monkeypatch.delenv(watchdog.HEARTBEAT_TIMEOUT_ENV, raising=False)
    assert watchdog.heartbeat_timeout(Cfg()) == 12.0
    assert watchdog.heartbeat_timeout(object()) == watchdog.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(watchdog.HEARTBEAT_TIMEOUT_ENV, "3.5")
    assert watchdog.heartbeat_timeout(Cfg()) == 3.5
    monkeypatch.setenv(watchdog.HEARTBEAT_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="HPC_RLHF_HEARTBEAT_TIMEOUT_S='soon' is not a number"):
        watchdog.heartbeat_timeout(Cfg())


# ============================================================================ several ranks on one store
class Ranks:
    """Watchdogs of a pretend world, each with its own client of one TCPStore, stepped by hand."""

    def __init__(self, port: int, world: int, roles: list[str], store_host_rank: int | None = 0):
        from torch.distributed import TCPStore

        self.port = port
        self.fatal: dict[int, str] = {}
        self.dogs = []
        for rank in range(world):
            client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=5))
            dog = Watchdog(client, rank, world, TIMEOUT, roles=[roles[rank]], interval_s=INTERVAL,
                           store_host_rank=store_host_rank, store_address=f"127.0.0.1:{port}",
                           on_fatal=lambda message, rank=rank: self.fatal.__setitem__(rank, message))
            self.dogs.append(dog)

    def beat(self, *ranks):
        for rank in ranks:
            self.dogs[rank].beat()


@pytest.fixture
def server():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield store.port


def test_healthy_ranks_raise_no_alarm(server):
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    for _ in range(12):
        world.beat(0, 1, 2)
        time.sleep(INTERVAL)
    assert world.fatal == {}
    assert world.dogs[0].peers[2].beat["role"] == "rollout"


def test_roles_named_by_a_function_are_asked_for_until_they_are_known(server):
    from torch.distributed import TCPStore

    known: list[str] | None = None
    client = TCPStore("127.0.0.1", server, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    dog = Watchdog(client, 0, 2, TIMEOUT, roles=lambda: known, interval_s=INTERVAL, store_host_rank=None)
    assert dog.role() == "trainer"  # before the recipe has made its role groups
    known = ["actor", "ref"]
    assert dog.role() == "actor+ref"
    known = None
    assert dog.role() == "actor+ref"  # asked until known, then kept
    assert Watchdog(client, 0, 2, TIMEOUT, roles=lambda: [], store_host_rank=None).role() == "none"


def test_a_silent_rank_is_reported_with_its_last_phase(server):
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    world.dogs[2].progress.name, world.dogs[2].progress.step = "scoring", 2
    world.beat(0, 1, 2)
    deadline = time.monotonic() + TIMEOUT + 1
    while time.monotonic() < deadline and 0 not in world.fatal:
        world.beat(0, 1)  # rank 2 has frozen
        time.sleep(INTERVAL)
    assert world.fatal[0].startswith("hpc_rlhf: rank 2 (role rollout) stopped responding during scoring: "
                                     "no heartbeat for")
    world.beat(1)  # rank 1 learns it from the published record even if it has not waited as long
    assert world.fatal[1].startswith("hpc_rlhf: rank 2 (role rollout) stopped responding during scoring")


def test_records_that_are_not_records_are_reported_once_and_the_frozen_rank_is_still_found(server, capfd):
    """Another user of the store's port writes junk into the failure log and over rank 1's heartbeat: each is
    reported once and skipped, nothing is blamed on it, and rank 2 freezing still ends the job within the
    timeout (a watchdog stopped by the first bad record would leave it to dist.timeout_s)."""
    from torch.distributed import TCPStore

    world = Ranks(server, 3, ["actor", "ref", "rollout"])  # (the harness's watchdogs use the store unprefixed)
    world.beat(0, 1, 2)
    intruder = TCPStore("127.0.0.1", server, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    intruder.append(liveness.FAILURE_LOG, "rank 1 (role ref) failed: go home\n")
    intruder.add(liveness.FAILURE_COUNT, 1)
    intruder.set(liveness.heartbeat_key(1), "not a heartbeat")  # until rank 1's next beat replaces it
    deadline = time.monotonic() + TIMEOUT + 1
    while time.monotonic() < deadline and 0 not in world.fatal:
        world.beat(0)
        world.beat(1)
        time.sleep(INTERVAL)
    assert world.fatal[0].startswith("hpc_rlhf: rank 2 (role rollout) stopped responding during setup")
    err = capfd.readouterr().err
    assert err.count("watchdog: skipped line 1 of the failure log: not JSON") == 2  # once per rank that read it
    assert err.count("watchdog: skipped the heartbeat of rank 1: not JSON") == 1  # rank 0 watches rank 1


def test_a_rank_that_never_beat_is_reported_after_the_timeout(server):
    world = Ranks(server, 2, ["actor", "ref"])
    world.beat(0)
    time.sleep(TIMEOUT + 0.1)
    world.beat(0)
    assert "rank 1 (role unknown) stopped responding during setup: no heartbeat at all" in world.fatal[0]


def test_a_dead_process_on_this_host_is_reported_at_once(server):
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    world.dogs[1].pid = victim.pid  # rank 1 "runs" in that process
    world.dogs[1].progress.name = "weight_sync"
    world.beat(0, 1, 2)
    assert world.fatal == {}
    victim.kill()
    victim.wait()
    world.beat(2)
    assert world.fatal[2] == (f"hpc_rlhf: rank 1 (role ref) failed during weight_sync: its process (pid "
                              f"{victim.pid}) is gone [step 0; seen by rank 2]")
    world.beat(0)
    assert "rank 1 (role ref) failed during weight_sync" in world.fatal[0]


def test_a_rank_that_stopped_in_order_is_not_a_failure(server):
    world = Ranks(server, 2, ["actor", "ref"])
    victim = subprocess.Popen([sys.executable, "-c", "pass"])
    world.dogs[1].pid = victim.pid
    world.beat(0, 1)
    world.dogs[1]._write_own(STOPPED)
    victim.wait()
    time.sleep(TIMEOUT + 0.1)
    world.beat(0)
    assert world.fatal == {}


def test_a_rank_ended_by_its_launchers_sigterm_is_not_blamed_for_the_death_of_another(server):
    # torchrun SIGTERMs every rank as soon as one dies; a rank still setting up dies of it, after saying so.
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    first, second = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    world.dogs[1].pid, world.dogs[2].pid = second.pid, first.pid
    world.dogs[2].progress.name = "exchange"
    world.beat(0, 1, 2)
    first.kill()  # rank 2 dies: the failure
    world.dogs[1].say_terminated()  # rank 1: SIGTERM from the launcher
    second.kill()
    first.wait()
    second.wait()
    world.beat(0)  # rank 0 watches rank 1 first, and finds both processes gone
    assert world.fatal[0].startswith("hpc_rlhf: rank 2 (role rollout) failed during exchange: its process"), \
        world.fatal


def _stand_in_for_rank_2(world: Ranks, phase: str) -> subprocess.Popen:
    """A process whose pid rank 2's heartbeat carries, in `phase`; every rank has beaten once since."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    world.dogs[2].pid = stand_in.pid
    world.dogs[2].progress.name = phase
    world.beat(2, 0, 1)  # rank 2 first: the others read its pid
    return stand_in


def test_a_rank_sigtermed_in_setup_names_the_failure_behind_the_signal(server):
    # srun --kill-on-bad-exit SIGTERMs every task a moment after one died; a rank still setting up (no stop
    # handler yet) waits a few beats for the cause before the signal ends it, so its output says why.
    world = Ranks(server, 3, ["actor", "ref", "rollout"], store_host_rank=None)
    dying = _stand_in_for_rank_2(world, "rollout")
    world.dogs[1].start()  # rank 1's thread runs, as in a real rank
    try:
        dying.kill()
        dying.wait()
        world.dogs[1].say_terminated()
        started = time.monotonic()  # rank 1's thread finds rank 2 gone within a beat
        world.dogs[1].await_cause()
        assert world.fatal[1].startswith("hpc_rlhf: rank 2 (role rollout) failed during rollout: its process"), \
            world.fatal
        assert time.monotonic() - started < world.dogs[1].grace
    finally:
        world.dogs[1].stop()


def test_without_a_cause_the_sigterm_ends_the_rank_after_a_few_beats(server):
    world = Ranks(server, 2, ["actor", "ref"], store_host_rank=None)
    world.beat(0, 1)
    world.dogs[1].start()
    world.dogs[1].say_terminated()
    started = time.monotonic()
    world.dogs[1].await_cause()
    waited = time.monotonic() - started
    assert world.fatal == {} and world.dogs[1].grace - 0.05 <= waited < world.dogs[1].grace + 1
    world.beat(0)
    assert world.fatal == {}  # rank 0 does not blame rank 1, whose last word was 'terminated'
    world.dogs[1].stop()


def test_a_rank_killed_for_freezing_is_named_as_frozen_by_a_rank_that_finds_its_process_gone(server):
    # Rank 1 found rank 2 frozen, published that and killed it, just after rank 0 had read the records: rank 0
    # then finds rank 2's process gone, and must name the freeze, not a death.
    world = Ranks(server, 3, ["actor", "ref", "rollout"], store_host_rank=None)
    frozen = _stand_in_for_rank_2(world, "weight_sync")
    world.dogs[1]._detected(world.dogs[1].peers[2], "stopped responding", "no heartbeat for 4 s")
    frozen.kill()
    frozen.wait()
    world.dogs[0]._judge_peers(time.monotonic())  # records last read before rank 1's
    assert world.fatal[0].startswith("hpc_rlhf: rank 2 (role rollout) stopped responding during weight_sync"), \
        world.fatal


def test_a_frozen_rank_on_this_host_is_killed_after_the_report(server):
    world = Ranks(server, 2, ["actor", "rollout"])
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        world.dogs[1].pid = frozen.pid
        world.dogs[1].progress.name = "weight_sync"
        world.beat(1, 0)  # rank 0 has read rank 1's last heartbeat
        time.sleep(TIMEOUT + 0.1)
        world.beat(0)
        assert world.fatal[0].endswith(f"its process (pid {frozen.pid}) is still there: killed (SIGKILL) "
                                       f"[step 0; seen by rank 0]"), world.fatal
        assert world.dogs[0].frozen_peer_pid == frozen.pid  # for the exit (exit_with_message), after the line
        assert frozen.poll() is None  # the test's on_fatal does not exit, so nothing killed it yet
        code = (f"from hpc_rlhf.dist.watchdog import exit_with_message; "
                f"exit_with_message('hpc_rlhf: test line', end_pid={frozen.pid})")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.strip() == "hpc_rlhf: test line"
        assert frozen.wait(timeout=10) == -signal.SIGKILL
    finally:
        frozen.kill()
        frozen.wait()


def test_a_reported_exception_reaches_every_rank(server):
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    world.beat(0, 1, 2)
    world.dogs[1].progress.name, world.dogs[1].progress.step = "training", 7
    world.dogs[1].report_failure(FloatingPointError("3 optimizer steps in a row had a non-finite loss"))
    world.beat(0, 1, 2)
    expected = ("hpc_rlhf: rank 1 (role ref) failed during training: FloatingPointError: 3 optimizer steps in a "
                "row had a non-finite loss [step 7; seen by rank {}]")
    assert world.fatal == {0: expected.format(0), 2: expected.format(2)}  # rank 1 itself prints its traceback


def test_an_effect_waits_for_its_cause(server):
    world = Ranks(server, 4, ["actor", "ref", "rollout", "rollout"])
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    world.dogs[3].pid = victim.pid
    world.dogs[3].progress.name = "exchange"
    del world.dogs[0].peers[3]  # as in a world of more than 9 ranks, rank 0 does not watch rank 3 itself
    world.beat(0, 1, 2, 3)
    victim.kill()
    victim.wait()
    # rank 1's collective with rank 3 broke: an effect, published as such
    world.dogs[1].report_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    world.beat(0)
    assert world.fatal == {}, "an effect alone must not be blamed before the grace time"
    world.beat(2)  # rank 2 watches rank 3 and sees its process gone: the cause
    world.beat(0)
    assert world.fatal[0].startswith("hpc_rlhf: rank 3 (role rollout) failed during exchange: its process")


def test_an_effect_is_blamed_when_no_cause_shows_up(server):
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    world.beat(0, 1, 2)
    world.dogs[1].report_failure(RuntimeError("Connection reset by peer"))
    world.beat(0)
    assert world.fatal == {}
    time.sleep(world.dogs[0].grace + 0.05)
    world.beat(0)
    assert world.fatal[0].startswith("hpc_rlhf: rank 1 (role ref) failed during setup: RuntimeError: "
                                     "Connection reset by peer")


def test_a_rank_waiting_on_an_endpoint_is_named_when_the_others_time_out(server):
    """The others' collectives time out (an effect) while a rank waits on an environment server: that rank and the
    server are the cause every rank reports, not the collective."""
    progress.reset()
    with watchdog.phase("rollout"), watchdog.waiting_on("environment http://env:8000/?..."):
        waiting = watchdog.current_phase()
    assert waiting == "rollout (waiting on environment http://env:8000/?...)"
    progress.reset()
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    world.dogs[2].progress.name = waiting
    world.beat(0, 1, 2)
    world.dogs[1].report_failure(RuntimeError("[gloo] Timed out waiting 300000ms for recv operation"))
    world.beat(2)  # rank 2 reads the effect while it waits: it held the others up
    world.beat(0)
    cause = ("hpc_rlhf: rank 2 (role rollout) held up the others during rollout (waiting on environment "
             "http://env:8000/?...): rank 1 gave up waiting for it (RuntimeError: [gloo] Timed out waiting 300000ms "
             "for recv operation)")
    assert world.fatal[2].startswith(cause) and world.fatal[0].startswith(cause)


def test_a_rank_waiting_on_an_endpoint_does_not_claim_a_lost_connection(server):
    world = Ranks(server, 3, ["actor", "ref", "rollout"])
    world.dogs[2].progress.name = "rollout (waiting on environment http://env:8000)"
    world.beat(0, 1, 2)
    world.dogs[1].report_failure(RuntimeError("Connection reset by peer"))  # a dead rank's doing, not a wait
    world.beat(2)
    assert 2 not in world.fatal or "held up" not in world.fatal[2]


def _store_host_process():
    """A process that hosts the store, standing in for rank 0."""
    code = ("import sys, time; from datetime import timedelta; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)); "
            "print(s.port, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


@pytest.fixture
def host_process():
    proc, port = _store_host_process()
    yield proc, port
    proc.kill()
    proc.wait()


def _threaded_world(port: int, host_pid: int):
    world = Ranks(port, 3, ["actor", "ref", "rollout"])
    world.dogs[0].pid = host_pid
    world.dogs[0].progress.name = "checkpoint"
    done = threading.Event()
    for dog in world.dogs:
        dog.on_fatal = lambda message, rank=dog.rank: (world.fatal.__setitem__(rank, message), done.set())
    world.dogs[0].beat()  # once by hand: rank 0's own watchdog "dies" with its process
    for dog in world.dogs[1:]:
        dog.start()
    return world, done


def test_the_store_host_dying_is_named(host_process):
    proc, port = host_process
    world, done = _threaded_world(port, proc.pid)
    time.sleep(3 * INTERVAL)
    proc.kill()
    assert done.wait(TIMEOUT + 5)
    time.sleep(0.2)
    for rank in (1, 2):
        assert world.fatal[rank].startswith(
            f"hpc_rlhf: rank 0 (role actor) failed during checkpoint: its process (pid {proc.pid}) is gone, and "
            f"with it the rendezvous store it hosted at 127.0.0.1:{port}")


def test_a_frozen_store_host_is_named_after_the_timeout(host_process):
    proc, port = host_process
    world, done = _threaded_world(port, proc.pid)
    time.sleep(3 * INTERVAL)
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGSTOP)
    assert done.wait(TIMEOUT + 5)
    assert time.monotonic() - start < TIMEOUT + 2
    message = next(iter(world.fatal.values()))
    assert message.startswith("hpc_rlhf: rank 0 (role actor) stopped responding during checkpoint")
    os.kill(proc.pid, signal.SIGCONT)


def test_the_store_host_stopping_in_order_is_no_failure(host_process):
    proc, port = host_process
    world, done = _threaded_world(port, proc.pid)
    world.dogs[0]._write_own(STOPPED)
    time.sleep(3 * INTERVAL)
    proc.kill()
    assert not done.wait(TIMEOUT + 1)
    assert world.fatal == {}
    assert all(dog._halt.is_set() for dog in world.dogs[1:])


def test_stop_writes_the_last_heartbeat(server):
    world = Ranks(server, 2, ["actor", "ref"])
    world.dogs[1].start()
    world.dogs[1].stop()
    world.beat(0)
    assert world.dogs[0].peers[1].beat["state"] == STOPPED
    assert not any(t.is_alive() for t in world.dogs[1]._threads)


def test_the_store_host_leaves_only_after_the_others_stopped(server):
    world = Ranks(server, 2, ["actor", "ref"])
    host = world.dogs[0]
    host.interval = 0.2  # waits at most 2 x grace = 1.2 s
    host.grace = 3 * host.interval
    world.beat(0, 1)
    threading.Timer(0.3, lambda: world.dogs[1]._write_own(STOPPED)).start()
    start = time.monotonic()
    host.stop()
    waited = time.monotonic() - start
    assert 0.25 < waited < 2 * host.grace - 0.05, waited


# ============================================================================================ whole worlds
from tests.distributed import REPO, rank_python, run_python, run_ranks, worker_env  # noqa: E402


def _spawn_local(nproc: int, case: str, fault: str = "", timeout_s: float = 3,
                 forked: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    """`case` on `nproc` ranks started by our local launcher (rank 0 forks the store's process), timed.

    `forked`: as `python -m hpc_rlhf` starts them on a CPU machine, forks of the process that found no launcher
    (here itself a fork of the tests' zygote: no interpreter pays the imports); otherwise each rank is a command
    (`spawn_local` with a command, as where torch has CUDA): the zygote's stand-in `python`, whose rank is forked
    (tests/zygote_python.py; a fresh interpreter costs about 5 CPU-seconds)."""
    env = worker_env({FAULT_ENV: fault, watchdog.HEARTBEAT_TIMEOUT_ENV: str(timeout_s)})
    start = time.monotonic()
    if forked:
        proc = run_python(None, __file__, [case, str(nproc)], env=env, timeout=120)
    else:
        code = ("import sys; from hpc_rlhf.launch.local import spawn_local; "
                f"sys.exit(spawn_local({nproc}, [{rank_python(env)!r}, {str(__file__)!r}, {case!r}]))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
    return proc, time.monotonic() - start


def test_local_world_a_frozen_rank_is_named_by_the_others():
    # Ranks started as commands: the launcher's other way, and a frozen one is found by its silence alike.
    proc, elapsed = _spawn_local(3, "phases", fault="rank=2,phase=scoring,step=2,kind=freeze", forked=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "hpc_rlhf: rank 2 (role rollout) stopped responding during scoring: no heartbeat for" in proc.stderr
    # The ranks that found it killed it: the launcher had no rank left to kill after its grace time.
    assert re.search(r"its process \(pid \d+\) is still there: killed \(SIGKILL\)", proc.stderr), proc.stderr[-3000:]
    assert "still running after" not in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60


def test_local_world_a_killed_rank_0_is_named_with_its_phase():
    # Rank 0's store process outlives it (hpc_rlhf.dist.store_host): the survivors read the phase it died in.
    proc, elapsed = _spawn_local(3, "phases", fault="rank=0,phase=training,step=2,kind=kill")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hpc_rlhf: rank")]
    assert len(lines) == 2 and all(re.match(r"hpc_rlhf: rank 0 \(role actor\) failed during training: its process "
                                            r"\(pid \d+\) is gone.*\[step 2; seen by rank [12]\]", line)
                                   for line in lines), proc.stderr[-3000:]
    assert elapsed < 60


def _store_death(debug: bool) -> subprocess.CompletedProcess:
    env = {"HPC_RLHF_DEBUG": "1"} if debug else {"HPC_RLHF_DEBUG": ""}
    code = ("import sys; from hpc_rlhf.launch.local import spawn_local; "
            f"sys.exit(spawn_local(2, [sys.executable, {str(__file__)!r}, 'store_dies']))")
    full_env = worker_env({watchdog.HEARTBEAT_TIMEOUT_ENV: "3", **env})
    full_env.pop("TORCH_CPP_LOG_LEVEL", None)  # as a user's shell has it: this test's process set it on import
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=120)


def test_local_world_a_killed_store_process_is_one_line_without_torchs_stack_dump():
    proc = _store_death(debug=False)
    assert proc.returncode != 0
    assert "hpc_rlhf: the rendezvous store at 127.0.0.1:" in proc.stderr, proc.stderr[-3000:]
    assert "frame #" not in proc.stderr, proc.stderr[-3000:]


def test_hpc_rlhf_debug_shows_torchs_stack_dump_of_a_killed_store():
    proc = _store_death(debug=True)
    assert proc.returncode != 0
    assert "hpc_rlhf: the rendezvous store at 127.0.0.1:" in proc.stderr, proc.stderr[-3000:]
    assert "frame #0: " in proc.stderr, proc.stderr[-3000:]


def test_local_world_finishing_at_different_times_is_no_failure():
    proc, _ = _spawn_local(3, "uneven")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hpc_rlhf: rank" not in proc.stderr


def test_local_world_a_rank_ended_by_sigterm_says_so_and_is_not_reported():
    proc, _ = _spawn_local(2, "sigterm_in_setup", timeout_s=1)
    assert "rank 1 of 2 was killed by signal SIGTERM" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0: no alarm" in proc.stdout, proc.stderr[-3000:]
    assert "hpc_rlhf: rank" not in proc.stderr, proc.stderr[-3000:]


def test_torchrun_a_killed_rank_is_named_by_the_others():
    env = {FAULT_ENV: "rank=2,phase=training,step=1,kind=kill", watchdog.HEARTBEAT_TIMEOUT_ENV: "3"}
    proc = run_ranks(3, __file__, "phases", env=env, check=False, timeout=120, launcher="torchrun")
    assert proc.returncode != 0
    assert "hpc_rlhf: rank 2 (role rollout) failed during training: its process" in proc.stderr, proc.stderr[-3000:]


def test_gloo_collectives_honour_the_timeout():
    proc = run_ranks(2, __file__, "collective_timeout", check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: RuntimeError after 2 s: " in proc.stdout and "Timed out waiting 2000ms" in proc.stdout


# ---------------------------------------------------------------------------------------------- workers
ROLES = ["actor", "ref", "rollout"]


def _world_size() -> int:
    """The ranks the case needs: its second argument where the case starts the world itself (`run_or_spawn` forks
    them), else the launcher's WORLD_SIZE."""
    return int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ["WORLD_SIZE"])


def _phases_worker() -> None:
    """Three steps of phases with a collective in each, as a recipe would run them."""
    import torch
    import torch.distributed as dist

    from hpc_rlhf.config import DistSection
    from hpc_rlhf.launch.local import run_or_spawn
    from hpc_rlhf.runtime.checkpointing import StopSignal

    class Cfg:
        dist = DistSection(timeout_s=120, nproc=_world_size())

    def run(cfg):
        rank = dist.get_rank()
        StopSignal()  # as in the recipes: torchrun's SIGTERM to the survivors only asks for a stop
        dog = watchdog.start([ROLES[rank]], watchdog.heartbeat_timeout(cfg), store_host_rank=store_host_rank())
        for step in range(1, 4):
            watchdog.set_step(step)
            for name in ("rollout", "scoring", "training"):
                with watchdog.phase(name):
                    time.sleep(2 * dog.interval)  # phases long enough for the peers to read their heartbeats
                    dist.all_reduce(torch.ones(1))

    sys.exit(run_or_spawn("test", Cfg(), run, []))


def _store_dies_worker() -> None:
    """Rank 0 kills its store's process (hpc_rlhf.dist.store_host) in step 2; both ranks' watchdogs use the store."""
    import torch
    import torch.distributed as dist

    from hpc_rlhf.config import DistSection
    from hpc_rlhf.dist import bootstrap
    from hpc_rlhf.launch.local import run_or_spawn

    class Cfg:
        dist = DistSection(timeout_s=120, nproc=_world_size())

    def run(cfg):
        rank = dist.get_rank()
        dog = watchdog.start([ROLES[rank]], watchdog.heartbeat_timeout(cfg), store_host_rank=store_host_rank())
        watchdog.set_step(2)
        with watchdog.phase("training"):
            dist.all_reduce(torch.ones(1))
            if rank == 0:
                os.kill(bootstrap._STORE_HOST.pid, signal.SIGKILL)
            time.sleep(30 * dog.interval)  # not to the end: the watchdogs find the store gone within a beat or two

    sys.exit(run_or_spawn("test", Cfg(), run, []))


def _uneven_worker() -> None:
    import torch.distributed as dist

    from hpc_rlhf.config import DistSection
    from hpc_rlhf.launch.local import run_or_spawn

    class Cfg:
        dist = DistSection(timeout_s=120, nproc=_world_size())

    def run(cfg):
        rank = dist.get_rank()
        watchdog.start([ROLES[rank]], 1.0, store_host_rank=store_host_rank())
        # Every rank is in the world first: a rank that left at once could close its connections while another
        # was still making its own (gloo's full mesh: "Connection closed by peer"), which is not this test's case.
        dist.barrier()
        # Rank 0 (the store's host) finishes first, the others over several heartbeat timeouts.
        time.sleep([0.0, 1.5, 3.0][rank])

    sys.exit(run_or_spawn("test", Cfg(), run, []))


def _sigterm_in_setup_worker() -> None:
    """Rank 1 is ended by SIGTERM before any stop handler is installed (as torchrun ends every rank once one
    has died, some of them still setting up); rank 0 keeps beating for a while, then says whether it is alive."""
    import torch.distributed as dist

    from hpc_rlhf.config import DistSection
    from hpc_rlhf.launch.local import run_or_spawn

    class Cfg:
        dist = DistSection(timeout_s=120, nproc=_world_size())

    def run(cfg):
        rank = dist.get_rank()
        dog = watchdog.start([ROLES[rank]], 1.0, store_host_rank=store_host_rank())
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # not reached: the signal's default action ends the process
        time.sleep(12 * dog.interval)  # a dead process on this host is found within one interval
        print("rank 0: no alarm", flush=True)
        os._exit(0)  # no final barrier: rank 1 is gone

    sys.exit(run_or_spawn("test", Cfg(), run, []))


def _collective_timeout_worker() -> None:
    import torch
    import torch.distributed as dist

    from hpc_rlhf.dist.bootstrap import init_distributed

    init_distributed("gloo", timeout_s=2)
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            print(f"rank 0: RuntimeError after {time.monotonic() - start:.0f} s: {exc}", flush=True)
    else:
        time.sleep(4)
    # A gloo group with a timed-out operation can abort in its destructor at interpreter exit: skip that.
    os._exit(0)


if __name__ == "__main__":
    {"phases": _phases_worker, "store_dies": _store_dies_worker, "uneven": _uneven_worker,
     "sigterm_in_setup": _sigterm_in_setup_worker, "collective_timeout": _collective_timeout_worker}[sys.argv[1]]()
