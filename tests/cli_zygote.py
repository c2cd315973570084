"""A pre-imported interpreter that the tests' command lines fork from (`hpc_rlhf_cli`, `run_ranks`, and the local
Slurm's ranks through tests/zygote_python.py).

    python tests/cli_zygote.py SOCKET        # started by tests/distributed.py `Zygote`: one per set of import-time
                                             # variables of a pytest process, and one for its local Slurm jobs
    python tests/cli_zygote.py SOCKET --on-first-request
                                             # the spawned children's zygote (tests/distributed.py `spawn_python`):
                                             # it imports vLLM's engine core with the rest once the first engine
                                             # core came, in that one's environment (earlier requests: refused);
                                             # `--without-vllm` leaves vLLM out (the protocol's own tests)

Every fresh interpreter of a test imports torch, transformers, deepspeed and datasets again: about 5 CPU-seconds,
more than most of the suite's command lines spend on their own work (a process-accounting run of the whole suite,
2026-11-27, counted about 200 such interpreters started by the two pytest lanes). This process imports them once,
then forks one child per request, and the child runs `python -m MODULE ARGS` or `python SCRIPT ARGS` as a fresh
interpreter would: the request's environment, working folder, standard streams and niceness, `sys.argv` and
`sys.path[0]` as Python sets them, and an end as the interpreter's (the code of the `SystemExit` or the traceback,
non-daemon threads waited for, atexit handlers, flushed streams), without its teardown of the modules. What a
library reads from the environment when it is imported cannot change after the fork, so the client sends here only
requests whose environment differs from this process's in no such variable (tests/distributed.py `zygote_for`: one
zygote per set of them).

Protocol, on a Unix socket of messages (SOCK_SEQPACKET) in a folder only this user can open: the client sends one
JSON object (module or script, argv, env, cwd, nice; optionally the CPUs it may run on and its umask) with three
file descriptors (stdin, stdout, stderr); a handler process forked for the connection forks the run, answers
`{"pid": PID}` (the run leads a process group of its own, which the client kills on a timeout), waits for it and
answers `{"returncode": CODE}` (minus the signal's number when a signal ended it). A client that hangs up first
takes the run with it: the handler kills the run's process group (tests/zygote_python.py stands in for a rank's
python under srun, and srun ends a step by killing its tasks). A request whose environment differs from this
process's in a variable read at import time is answered `{"refused": "VARIABLE"}`: the client then starts a fresh
interpreter.

A request may carry more descriptors, with the numbers the child must find them under (`fds`: a child that
multiprocessing spawns reads its process object from a pipe it is told the number of), and Python code to run as
`python -c` does (`code`). The runs of a request with `spawn_python` (the path of a script that runs
tests/zygote_python.py with a spawned children's zygote) spawn their multiprocessing children through it.
"""

from __future__ import annotations

import fcntl
import gc
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import types

from tests.distributed import import_time_environment
from tests.zygote_python import is_open

MAX_REQUEST_BYTES = 1 << 20
MAX_FDS = 32
PARENT_POLL_S = 1.0


def _warm_up(vllm_children: bool = False) -> None:
    """Import what the suite's command lines import before their own code runs (with `vllm_children`, what
    vLLM's engine core imports too)."""
    import hpc_rlhf  # noqa: F401  (pins the CPU kernels before torch loads, as in every rank)
    import torch  # noqa: F401  (its threads follow OMP_NUM_THREADS, as in a fresh interpreter)

    from hpc_rlhf.launch.local import import_what_ranks_use

    import_what_ranks_use()
    import transformers.models.llama.modeling_llama  # noqa: F401  (the tiny models' architecture)

    import hpc_rlhf.utils.process_end  # noqa: F401  (how every run ends: _handle)

    import multiprocessing.spawn  # noqa: F401  (what a spawned child runs first)

    if vllm_children and importlib.util.find_spec("vllm") is not None:
        import vllm.v1.engine.core  # noqa: F401  (the engine core's process function)


def _run(request: dict) -> None:
    """In the forked child: become the requested process and run it; it returns or raises, and _handle ends the
    process through end_process."""
    os.chdir(request["cwd"])
    if request.get("cpus"):
        os.sched_setaffinity(0, request["cpus"])  # what Slurm's task binding gave the client
    if request.get("umask") is not None:
        os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # cached by the zygote's imports (the op probe makes folders): read the request's TMPDIR
    try:
        if request.get("priority") is not None:  # a spawned child's: its parent's niceness
            os.setpriority(os.PRIO_PROCESS, 0, request["priority"])
        elif request.get("nice"):
            os.nice(request["nice"])
    except OSError:
        pass  # not allowed to this user: a priority only changes who waits for whom
    if request.get("unbuffered"):  # `python -u`: what is printed goes out at once, as the kernel's write
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                      errors=sys.stdout.errors, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                      errors=sys.stderr.errors, write_through=True)
    if request.get("spawn_python"):
        import multiprocessing

        multiprocessing.set_executable(request["spawn_python"])
    if request.get("module"):
        sys.argv = ["-m", *request["argv"]]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()  # as for `python -m`
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    elif request.get("code") is not None:
        sys.argv = ["-c", *request["argv"]]
        sys.path[0] = ""  # as for `python -c`
        sys.dont_write_bytecode = bool(request.get("dont_write_bytecode"))
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    else:
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as for `python SCRIPT`
        runpy.run_path(script, run_name="__main__")


def _is_ours(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen runpy")


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, MAX_FDS)
    return json.loads(message), fds


def _refusal(request: dict, fds: list[int], import_time: tuple, conn: socket.socket) -> list[str]:
    """Why this zygote cannot run the request (empty: it can): the variables read at import time that differ, or
    the descriptor numbers the child must have that this process holds already."""
    differing = dict(set(import_time) ^ set(import_time_environment(request["env"])))
    if differing:
        return sorted(differing)
    targets = _targets(request)
    if len(fds) != len(targets):
        return [f"{len(fds)} descriptors for {len(targets)} numbers"]
    held = {int(name) for name in os.listdir("/proc/self/fd")} - set(fds) - {conn.fileno()}
    return [f"descriptor {fd}" for fd in sorted(held & set(targets[3:])) if is_open(fd)]  # not the listing's own



def _targets(request: dict) -> list[int]:
    return [0, 1, 2, *request.get("fds", [])]


def _give_descriptors(fds: list[int], targets: list[int]) -> None:
    """In the run: each received descriptor under its number, through numbers above all of them."""
    above = max([*fds, *targets]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, moved):
        os.dup2(fd, target)  # inheritable, as multiprocessing passes them
        os.close(fd)


def _handle(conn: socket.socket, import_time: tuple, received: tuple[dict, list[int]] | None = None) -> None:
    """In the handler process of one connection: fork the run, report its pid and its exit, exit."""
    request, fds = received or _receive(conn)
    refusal = _refusal(request, fds, import_time, conn)
    if refusal:
        print(f"tests/cli_zygote.py: refused a request: {', '.join(refusal)} differ(s) from this zygote's",
              file=sys.stderr, flush=True)
        conn.send(json.dumps({"refused": refusal}).encode())
        os._exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)
        _give_descriptors(fds, _targets(request))
        # As a fresh interpreter ends, but without its teardown, which frees every object the zygote imported: ~3
        # of a trivial run's 3.5 CPU-seconds after a fork (hpc_rlhf.utils.process_end). Frozen out of reach instead
        # (main), those objects would be left behind, and extensions such as triton's report them as leaked.
        from hpc_rlhf.utils.process_end import end_process

        end_process(lambda: _run(request), hidden_frames=_is_ours)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    run_ended = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([run_ended, conn], [], [])
        if run_ended in ready:
            break
        if not conn.recv(4096):  # the client hung up (it sends nothing else): the run goes with it
            _kill_group(pid)
            os.waitpid(pid, 0)
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.send(json.dumps({"returncode": code}).encode())
    except OSError:
        pass  # the client went as the run ended
    conn.close()
    os._exit(0)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _ready_for(env: dict[str, str], vllm_children: bool) -> tuple:
    """Import, with `env` as the environment; the variables read at import time, as the client saw them."""
    os.environ.clear()
    os.environ.update(env)
    import_time = import_time_environment(dict(os.environ))  # before the imports' own settings
    _warm_up(vllm_children)
    # What the imports made is never garbage: out of the collector's reach (hpc_rlhf.launch.local says why, for the
    # ranks it forks), a run's collections walk only its own objects (a 2-step GRPO run: 3.0 -> 2.7 CPU-s).
    gc.collect()
    gc.freeze()
    return import_time


def _is_an_engine_core(request: dict) -> bool:
    """Whether a spawned child is vLLM's engine core as our engines start it (hpc_rlhf.engines.rollout.vllm
    `worker_environment`): the environment the spawned children's zygote takes for its own. A first child of
    another kind, or of another environment, would have every engine core after it refused."""
    return request["env"].get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"


def main(path: str, on_first_request: bool = False, with_vllm: bool = True) -> None:
    """Serve requests on `path`; `on_first_request`: import only when the first request came, in its environment
    (the spawned children's zygote: their parents' environment is known only then), vLLM's engine core too unless
    not `with_vllm`."""
    import_time = None if on_first_request else _ready_for(dict(os.environ), vllm_children=False)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    server.settimeout(PARENT_POLL_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers are reaped by the kernel
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            if os.getppid() != parent:  # the pytest process is gone (PR_SET_PDEATHSIG would follow its thread)
                return
            continue
        conn.settimeout(None)
        received = None
        if import_time is None:
            try:
                received = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            if not _is_an_engine_core(received[0]):  # spawned as the library does, and the next one may be
                conn.send(json.dumps({"refused": ["not vLLM's engine core"]}).encode())
                conn.close()
                for fd in received[1]:
                    os.close(fd)
                continue
            import_time = _ready_for(received[0]["env"], vllm_children=with_vllm)
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the handler waits for its run
            _handle(conn, import_time, received)  # the run leaves through SystemExit; the handler by os._exit
        conn.close()
        for fd in received[1] if received else []:
            os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1], on_first_request="--on-first-request" in sys.argv[2:],
         with_vllm="--without-vllm" not in sys.argv[2:])
