"""A pre-imported interpreter that the tests' command lines fork from (`hpc_rlhf_cli`, `run_ranks`).

    python tests/cli_zygote.py SOCKET        # started by tests/distributed.py, one per pytest process

Every fresh interpreter of a test imports torch, transformers, deepspeed and datasets again: about 5 CPU-seconds,
more than most of the suite's command lines spend on their own work (a process-accounting run of the whole suite,
2026-11-27, counted about 200 such interpreters started by the two pytest lanes). This process imports them once,
then forks one child per request, and the child runs `python -m MODULE ARGS` or `python SCRIPT ARGS` as a fresh
interpreter would: the request's environment, working folder, standard streams and niceness, `sys.argv` and
`sys.path[0]` as Python sets them, and an exit through the interpreter's own shutdown (atexit handlers, flushed
streams) with the code of the `SystemExit`. What a library reads from the environment when it is imported cannot
change after the fork, so the client sends here only requests whose environment differs from this process's in
no such variable (tests/distributed.py `zygote_for`: one zygote per set of them).

Protocol, on a Unix socket of messages (SOCK_SEQPACKET) in a folder only this user can open: the client sends one JSON object (module or script,
argv, env, cwd, nice) with three file descriptors (stdin, stdout, stderr); a handler process forked for the
connection forks the run, answers `{"pid": PID}` (the run leads a process group of its own, which the client kills
on a timeout), waits for it and answers `{"returncode": CODE}` (minus the signal's number when a signal ended it).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys

MAX_REQUEST_BYTES = 1 << 20
PARENT_POLL_S = 1.0


def _warm_up() -> None:
    """Import what the suite's command lines import before their own code runs."""
    import hpc_rlhf  # noqa: F401  (pins the CPU kernels before torch loads, as in every rank)
    import torch  # noqa: F401  (its threads follow OMP_NUM_THREADS, as in a fresh interpreter)

    from hpc_rlhf.launch.local import import_what_ranks_use

    import_what_ranks_use()
    import transformers.models.llama.modeling_llama  # noqa: F401  (the tiny models' architecture)


def _run(request: dict) -> None:
    """In the forked child: become the requested process and run it; leaves through SystemExit."""
    os.chdir(request["cwd"])
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


def _handle(conn: socket.socket) -> None:
    """In the handler process of one connection: fork the run, report its pid and its exit, exit."""
    message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _run(request)
        raise SystemExit(0)  # the script ended without sys.exit: what a fresh interpreter reports
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    conn.send(json.dumps({"returncode": code}).encode())
    conn.close()
    os._exit(0)


def main(path: str) -> None:
    _warm_up()
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
            _handle(conn)  # the run's process leaves from here through SystemExit; the handler by os._exit
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
