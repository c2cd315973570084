"""A pre-imported interpreter that the tests' command lines fork from (`hpc_rlhf_cli`, `run_ranks`, and the local
Slurm's ranks through tests/zygote_python.py).

    python tests/cli_zygote.py SOCKET        # started by tests/distributed.py `Zygote`: one per set of import-time
                                             # variables of a pytest process, and one for its local Slurm jobs

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
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import socket
import sys

from tests.distributed import import_time_environment

MAX_REQUEST_BYTES = 1 << 20
PARENT_POLL_S = 1.0


def _warm_up() -> None:
    """Import what the suite's command lines import before their own code runs."""
    import hpc_rlhf  # noqa: F401  (pins the CPU kernels before torch loads, as in every rank)
    import torch  # noqa: F401  (its threads follow OMP_NUM_THREADS, as in a fresh interpreter)

    from hpc_rlhf.launch.local import import_what_ranks_use

    import_what_ranks_use()
    import transformers.models.llama.modeling_llama  # noqa: F401  (the tiny models' architecture)

    import hpc_rlhf.utils.process_end  # noqa: F401  (how every run ends: _handle)


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
    if request.get("nice"):
        try:
            os.nice(request["nice"])
        except OSError:
            pass  # not allowed to this user: a priority only changes who waits for whom
    if request.get("module"):
        sys.argv = ["-m", *request["argv"]]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()  # as for `python -m`
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as for `python SCRIPT`
        runpy.run_path(script, run_name="__main__")


def _is_ours(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen runpy")


def _handle(conn: socket.socket, import_time: tuple) -> None:
    """In the handler process of one connection: fork the run, report its pid and its exit, exit."""
    message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
    request = json.loads(message)
    differing = dict(set(import_time) ^ set(import_time_environment(request["env"])))
    if differing:
        print(f"tests/cli_zygote.py: refused a request whose {', '.join(sorted(differing))} differ(s) from this "
              "zygote's", file=sys.stderr, flush=True)
        conn.send(json.dumps({"refused": sorted(differing)}).encode())
        os._exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
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


def main(path: str) -> None:
    import_time = import_time_environment(dict(os.environ))  # as the client saw it, before the imports' own settings
    _warm_up()
    # What the imports made is never garbage: out of the collector's reach (hpc_rlhf.launch.local says why, for the
    # ranks it forks), a run's collections walk only its own objects (a 2-step GRPO run: 3.0 -> 2.7 CPU-s).
    gc.collect()
    gc.freeze()
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
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the handler waits for its run
            _handle(conn, import_time)  # the run leaves from here through SystemExit; the handler by os._exit
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
