"""The tests' command lines forked from the pre-imported interpreter (tests/cli_zygote.py) behave as fresh
interpreters: the same arguments, environment, folder, streams and exit codes; a timeout ends the run with its
children; an environment a library reads at import time gets a zygote of its own."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import distributed
from tests.cli_zygote import PARENT_POLL_S
from tests.distributed import FRESH_VAR, REPO, Zygote, import_time_environment, run_python, worker_env, zygote_for
from tests.zygote_python import SOCKET_VAR, START_TIMEOUT_VAR

@pytest.fixture(autouse=True, scope="module")
def own_zygotes():
    """This module's zygotes, apart from the session's (which may already hold their maximum), stopped after it;
    but the session's zygote of the suite's usual environment, when there is one, serves this module too."""
    usual = import_time_environment(worker_env())
    session = {usual: distributed._ZYGOTES[usual]} if distributed._ZYGOTES.get(usual) is not None else {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "_ZYGOTES", dict(session))
        patch.setattr(distributed, "MAX_ZYGOTES", 8)
        yield
        for key, zygote in distributed._ZYGOTES.items():
            if zygote is not None and key not in session:
                zygote.stop()


PROBE = """
import json, os, sys, tempfile
print(json.dumps({"argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "marker": os.environ.get("HPC_RLHF_PROBE"), "torch_loaded": "torch" in sys.modules,
                  "temp": tempfile.gettempdir()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def both_ways(script, argv, env, monkeypatch):
    assert zygote_for(env) is not None
    forked = run_python(None, str(script), argv, env=env, timeout=60)
    monkeypatch.setenv(FRESH_VAR, "1")
    fresh = run_python(None, str(script), argv, env=env, timeout=60)
    monkeypatch.delenv(FRESH_VAR)
    return forked, fresh


def test_a_forked_script_sees_what_a_fresh_interpreter_sees(tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = worker_env({"HPC_RLHF_PROBE": "forked or not", "TMPDIR": str(tmp_path)})
    forked, fresh = both_ways(script, ["3", "a b", "--flag"], env, monkeypatch)
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (3, "to stderr\n")
    f, g = (json.loads(p.stdout) for p in (forked, fresh))
    assert f.pop("torch_loaded") and not g.pop("torch_loaded")  # the fork saved the import, nothing else differs
    assert f == g == {"argv": ["3", "a b", "--flag"], "path0": str(tmp_path), "cwd": str(REPO), "name": "__main__",
                      "marker": "forked or not", "temp": str(tmp_path)}
    # The temporary folder is no import-time variable: one zygote serves requests with different ones, each its own.
    other = tmp_path / "other"
    other.mkdir()
    again = run_python(None, str(script), ["0"], env={**env, "TMPDIR": str(other)}, timeout=60)
    seen = json.loads(again.stdout)
    assert seen["torch_loaded"] and seen["temp"] == str(other)  # forked, yet its own folder
    assert zygote_for(env) is zygote_for({**env, "TMPDIR": "/x"})


ENDINGS = """
import atexit, sys, threading, time
atexit.register(print, "atexit handler ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
print("buffered, never flushed by the script", end="")
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "text":
    sys.exit("a message for the exit")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("ending", ["raise", "text", "0", "5"])
def test_a_forked_script_ends_as_a_fresh_interpreter_ends(ending, tmp_path, monkeypatch):
    """Its threads waited for, its atexit handlers run, its streams flushed, the exit code and the traceback (from
    the script's own frame on) of its exception, though the fork leaves by os._exit."""
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS)
    forked, fresh = both_ways(script, [ending], worker_env({"PYTHONUNBUFFERED": ""}), monkeypatch)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "thread finished" in fresh.stdout and "atexit handler ran" in fresh.stdout
    assert fresh.returncode == {"raise": 1, "text": 1, "0": 0, "5": 5}[ending]


def test_a_forked_module_run_exits_as_python_m_does():
    proc = run_python("hpc_rlhf", None, ["no-such-mode"], env=worker_env(), timeout=60)
    assert proc.returncode == 2 and "unknown mode 'no-such-mode'" in proc.stderr


def test_a_timeout_kills_the_run_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "sleeper.py"
    script.write_text("import subprocess, sys, time\n"
                      f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                      "time.sleep(600)\n")
    assert zygote_for(worker_env()) is not None
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(None, str(script), [], env=worker_env(), timeout=3)
    assert time.monotonic() - started < 60
    child = int(pid_file.read_text())
    for _ in range(100):  # the kill is sent; the kernel may take a moment to reap
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the timed-out run's child {child} is still running")


@pytest.mark.parametrize("variable, value", [("HF_HUB_OFFLINE", "0"), ("HPC_RLHF_CPU_KERNELS", "native"),
                                             ("PYTHONHASHSEED", "7"), ("TORCH_LOGS", "+dynamo")])
def test_an_environment_read_at_import_time_keys_a_zygote_of_its_own(variable, value):
    usual = import_time_environment(worker_env())
    assert import_time_environment({**worker_env(), "HPC_RLHF_SOMETHING_READ_LATER": "1", "LOCAL_RANK": "0"}) == usual
    assert import_time_environment({**worker_env(), variable: value}) != usual


def test_the_library_path_keys_a_zygote_by_the_folders_the_linker_would_search(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    base = {k: v for k, v in worker_env().items() if k != "LD_LIBRARY_PATH"}

    def key(value):
        return import_time_environment({**base, "LD_LIBRARY_PATH": value})

    missing = str(tmp_path / "lib64")  # what OpenCV's loader prepends, in every process that imports it
    assert key(f"{missing}:{missing}:{first}:") == key(f"{first}") == key(f"{first}:{first}")
    assert key(f"{missing}:") == key("") == import_time_environment(base)
    assert key(f"{first}:{second}") != key(f"{second}:{first}")  # the order decides which library is found
    assert key(f"{first}") != key(f"{first}:{second}")


def test_an_environment_read_at_import_time_gets_a_zygote_of_its_own():
    """The key above, with real zygotes (each start pays the imports: one variable stands for the others)."""
    zygote = zygote_for(worker_env())
    assert zygote is not None
    assert zygote_for({**worker_env(), "HPC_RLHF_SOMETHING_READ_LATER": "1", "LOCAL_RANK": "0"}) is zygote
    assert zygote_for({**worker_env(), "PYTHONHASHSEED": "7"}) not in (zygote, None)


def test_an_environment_the_imports_refuse_gets_a_fresh_interpreter_and_its_error(tmp_path):
    env = {**worker_env(), "DS_ACCELERATOR": "no-such-accelerator"}
    assert zygote_for(env) is None
    script = tmp_path / "accelerator.py"
    script.write_text("from deepspeed.accelerator import get_accelerator\nget_accelerator()\n")
    proc = run_python(None, str(script), [], env=env, timeout=120)
    assert proc.returncode == 1 and "no-such-accelerator" in proc.stderr


def test_more_than_one_thread_gets_a_fresh_interpreter():
    assert zygote_for(worker_env({"OMP_NUM_THREADS": "2"})) is None


def test_the_zygote_socket_is_private():
    assert os.stat(os.path.dirname(zygote_for(worker_env()).path)).st_mode & 0o077 == 0


def test_a_zygote_started_by_a_thread_outlives_that_thread():
    """The shared models' background threads make the first requests: the zygote must not end with them. (One that
    imports at its first request: how it lives and watches its parent is every zygote's, without the imports.)"""
    import socket

    zygote = Zygote()
    starter = threading.Thread(target=zygote.start, args=(worker_env(),), kwargs={"on_first_request": True})
    starter.start()
    starter.join()
    time.sleep(2 * PARENT_POLL_S)  # the zygote looks at its parent once per PARENT_POLL_S
    try:
        assert zygote.proc.poll() is None
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(zygote.path)  # still serving
    finally:
        zygote.stop()


def test_a_zygote_that_hangs_up_is_named_not_a_json_error(tmp_path):
    import socket

    path = str(tmp_path / "socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    hang_up = threading.Thread(target=lambda: server.accept()[0].close())
    hang_up.start()
    zygote = Zygote()
    zygote.path = path
    with pytest.raises(RuntimeError, match="closed the connection before starting"):
        zygote.run("hpc_rlhf", None, ["sft"], worker_env(), timeout=10, priority=0)
    hang_up.join()
    server.close()


# ------------------------------------------------------------ tests/zygote_python.py: a Slurm rank's python
STAND_IN = [sys.executable, str(REPO / "tests" / "zygote_python.py")]
RANK = """
import os, signal, sys, time
def stop(signum, frame):
    print("stopping on", signal.Signals(signum).name, flush=True)
    sys.exit(75)
signal.signal(signal.SIGUSR1, stop)
print(os.getpid(), "torch" in sys.modules, os.getcwd(), sys.argv[1:], flush=True)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "signal":
    os.kill(os.getpid(), int(sys.argv[2]))
time.sleep(600)
"""


def stand_in(tmp_path, *argv, env_extra=None):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = worker_env({SOCKET_VAR: zygote_for(worker_env()).path, **(env_extra or {})})
    return subprocess.Popen([*STAND_IN, "rank.py", *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def first_line(proc) -> list[str]:
    return proc.stdout.readline().rstrip("\n").split(maxsplit=3)


def test_the_stand_in_runs_the_rank_forked_and_ends_as_it_does(tmp_path):
    proc = stand_in(tmp_path, "exit", "3")
    pid, torch_loaded, cwd, argv = first_line(proc)
    assert (torch_loaded, cwd, argv) == ("True", str(tmp_path), "['exit', '3']")
    assert proc.wait(60) == 3
    proc = stand_in(tmp_path, "signal", str(int(signal.SIGTERM)))
    first_line(proc)
    assert proc.wait(60) == -signal.SIGTERM  # death by the same signal, as srun would see it


def wait_or_say_why(proc, rank: int, timeout_s: float = 60) -> int:
    """The stand-in's exit code; if it does not end in time, an error with what the rank's process was doing (its
    state and signal masks, from /proc) and what the stand-in wrote to stderr. It timed out once in a fresh-clone
    suite (2026-11-30, the learning lane) with nothing to go on."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            lines = Path(f"/proc/{rank}/status").read_text().splitlines()
            status = "; ".join(line for line in lines if line.split(":")[0] in
                               ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "Threads"))
        except OSError:
            status = "gone"
        for pid, kill in ((rank, os.killpg), (proc.pid, os.kill)):
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, err = proc.communicate()
        raise AssertionError(f"the stand-in did not end within {timeout_s} s; rank process {rank}: {status}; "
                             f"the stand-in's stderr: {err[-2000:]!r}") from None


def test_a_stop_signal_to_the_stand_in_reaches_the_rank(tmp_path):
    proc = stand_in(tmp_path, "sleep")
    rank = int(first_line(proc)[0])
    proc.send_signal(signal.SIGUSR1)
    assert wait_or_say_why(proc, rank) == 75
    assert proc.stdout.read() == "stopping on SIGUSR1\n"


def test_a_killed_stand_in_takes_its_rank_along(tmp_path):
    proc = stand_in(tmp_path, "sleep")
    rank = int(first_line(proc)[0])
    proc.kill()  # srun's end of a step: SIGKILL, which the stand-in cannot pass on
    proc.wait(60)
    for _ in range(100):
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"rank process {rank} outlived its killed stand-in")


TORCHRUN_WORKER = """
import os, sys
print("torch" in sys.modules, "TORCHELASTIC_RUN_ID" in os.environ, os.environ["RANK"])
os._exit(0)  # what a buffered stdout still held would be lost: torchrun's `-u` writes it at once
"""


def test_torchruns_workers_fork_from_the_zygote_with_unbuffered_output(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    buffered = worker_env({"PYTHONUNBUFFERED": ""})  # the tests' runs write unbuffered anyway
    proc = distributed.torchrun(["--standalone", "--nproc_per_node=2", "--max_restarts=0", str(script)],
                                env=buffered, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.splitlines()) == ["True True 0", "True True 1"], proc.stderr[-3000:]


def test_the_stand_in_takes_no_other_flag_of_torchruns_command_line():
    from tests.zygote_python import request_for

    assert request_for(["-u", "-m", "hpc_rlhf", "sft"])["unbuffered"]
    assert request_for(["-u", "-c", "print(1)"]) is None and request_for(["-u", "-O", "x.py"]) is None


def test_a_request_the_zygote_refuses_runs_in_a_fresh_interpreter(tmp_path):
    proc = stand_in(tmp_path, "exit", "0", env_extra={"HF_HUB_OFFLINE": "0"})
    assert first_line(proc)[1] == "False"  # torch not imported: a fresh interpreter
    assert proc.wait(60) == 0


def test_a_zygote_that_never_answers_leaves_the_rank_to_a_fresh_interpreter(tmp_path):
    import socket

    path = str(tmp_path / "wedged")
    wedged = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # takes connections into its backlog, never reads
    wedged.bind(path)
    wedged.listen(4)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = worker_env({SOCKET_VAR: path, START_TIMEOUT_VAR: "1"})
    # Files, not pipes: the request unread in the wedged socket holds copies of the stand-in's streams, so a pipe
    # would not reach its end until the socket closes.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([*STAND_IN, "rank.py", "exit", "4"], cwd=tmp_path, env=env, stdout=out, stderr=err)
        try:
            code = proc.wait(120)
        finally:
            proc.kill()
            wedged.close()
    assert code == 4
    assert (tmp_path / "out").read_text().split()[1] == "False"  # no torch: the fresh interpreter ran the rank
    assert f"the zygote at {path} did not answer" in (tmp_path / "err").read_text()


def test_a_start_timeout_that_is_not_a_number_is_named(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = worker_env({SOCKET_VAR: str(tmp_path / "no-socket"), START_TIMEOUT_VAR: "soon"})
    proc = subprocess.run([*STAND_IN, "rank.py", "exit", "0"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert f"{START_TIMEOUT_VAR}='soon' must be a number of seconds above 0" in proc.stderr


# ------------------------------------------------- children that multiprocessing spawns in a forked run (vLLM's)
SPAWNER = """
import json, multiprocessing, os, signal, sys, time

def child(queue, code):
    queue.put({"ppid": os.getppid(), "torch_loaded": "torch" in sys.modules, "argv": sys.argv,
               "marker": os.environ.get("HPC_RLHF_PROBE"), "cwd": os.getcwd(), "nice": os.nice(0)})
    sys.exit(code)

def sleeper():
    time.sleep(600)

if __name__ == "__main__":
    os.environ.update(json.loads(os.environ.pop("HPC_RLHF_PROBE_CHILD_ENV", "{}")))  # as our vLLM engine does
    os.nice(2)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    answering = context.Process(target=child, args=(queue, 7))
    answering.start()
    answer = queue.get(timeout=120)
    answering.join(120)
    stopped = context.Process(target=sleeper)
    stopped.start()
    time.sleep(0.5)
    stopped.terminate()
    stopped.join(60)
    print(json.dumps({"pid": os.getpid(), "nice": os.nice(0), "child": answer,
                      "exitcodes": [answering.exitcode, stopped.exitcode]}))
"""


@pytest.fixture(scope="module")
def own_spawn_zygote():
    """A spawned children's zygote of this module's own (the session's took the environment of its first engine
    core), which takes that of spawner_run's engine-like children; without vLLM's imports (19 CPU-seconds), which
    these children do not use."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(distributed.SPAWN_PYTHON_VAR, raising=False)
        patch.setattr(distributed, "_SPAWN_ZYGOTE", [distributed.start_spawn_zygote(with_vllm=False)])
        yield
        for zygote, _ in distributed._SPAWN_ZYGOTE:
            if zygote is not None:
                zygote.stop()


# What our vLLM engines put in the environment of the engine core (hpc_rlhf.engines.rollout.vllm.worker_environment):
# the spawned children's zygote takes the environment of the first child that has it.
ENGINE_LIKE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def spawner_run(tmp_path, child_env=None, run_env=None):
    """The spawner forked from the session's usual zygote (`run_env` adds no variable read at import time); it puts
    `child_env` in its environment before it spawns, as our vLLM engine puts the engine core's (a run started with
    those variables would need a zygote of its own, ~12 CPU-seconds of imports each)."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    env = worker_env({"HPC_RLHF_PROBE": "spawned", "HPC_RLHF_PROBE_CHILD_ENV": json.dumps(child_env or {}),
                      **(run_env or {})})
    assert import_time_environment(env) == import_time_environment(worker_env())
    proc = run_python(None, str(script), [], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_spawn_zygote_takes_the_first_engine_cores_environment_and_refuses_others(tmp_path,
                                                                                        own_spawn_zygote):
    """Spawned children of another kind than vLLM's engine core (first here) and engine cores whose variables read at
    import time differ from the first engine core's are spawned as multiprocessing does: a fresh interpreter."""
    other_kind = spawner_run(tmp_path)
    first = spawner_run(tmp_path, ENGINE_LIKE)
    other_environment = spawner_run(tmp_path, {**ENGINE_LIKE, "HF_HUB_OFFLINE": "0"})
    assert first["child"]["torch_loaded"]
    assert not other_kind["child"]["torch_loaded"] and not other_environment["child"]["torch_loaded"]
    for run in (other_kind, other_environment):
        assert run["exitcodes"] == [7, -signal.SIGTERM] and run["child"]["marker"] == "spawned"
        assert run["child"]["ppid"] == run["pid"]


def test_a_spawned_child_forks_from_the_spawn_zygote_and_runs_as_spawned(tmp_path, monkeypatch, own_spawn_zygote):
    """A forked run's spawned child comes from the spawned children's zygote (not the run's child, its imports
    done), yet gets what a spawned child gets: its arguments through the pipe multiprocessing passed on under its
    number (a queue's descriptors too), the environment, folder and niceness of its parent, its exit code, and the
    SIGTERM of terminate(); with REAL_SPAWN_VAR=1, or in a fresh interpreter, multiprocessing spawns it itself."""
    zygoted = spawner_run(tmp_path, ENGINE_LIKE)
    real = spawner_run(tmp_path, ENGINE_LIKE, run_env={distributed.REAL_SPAWN_VAR: "1"})
    monkeypatch.setenv(FRESH_VAR, "1")
    fresh = spawner_run(tmp_path, ENGINE_LIKE)
    for run in (zygoted, real, fresh):
        assert run["exitcodes"] == [7, -signal.SIGTERM]
        assert {k: run["child"][k] for k in ("marker", "cwd", "nice")} == {"marker": "spawned", "cwd": str(REPO),
                                                                            "nice": run["nice"]}
        assert run["child"]["argv"] == [str(tmp_path / "spawner.py")]  # the parent's, as spawn hands it on
    assert zygoted["child"]["ppid"] != zygoted["pid"] and zygoted["child"]["torch_loaded"]
    assert real["child"]["ppid"] == real["pid"] and not real["child"]["torch_loaded"]
    assert fresh["child"]["ppid"] == fresh["pid"]
