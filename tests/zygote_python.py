"""`python` for the local Slurm's ranks: `python -m MODULE ARGS` or `python SCRIPT ARGS`, forked from a zygote.

    PYTHON="$VENV/bin/python tests/zygote_python.py" HPC_RLHF_TEST_ZYGOTE=SOCKET sbatch sbatch/tiny_cpu.sbatch

The cluster tests' jobs start about fifty ranks, each a fresh interpreter that imports torch, transformers and
deepspeed again (13 CPU-seconds a rank on average in the process accounting of a fresh-clone suite, 2026-11-28:
743 of the suite's 4,866). tests/cluster/conftest.py starts one zygote (tests/cli_zygote.py) for the session's
jobs and names this file as their PYTHON (launch/env.sh): each rank's command then costs an interpreter that
imports nothing heavy, and the zygote forks the rank, which runs as a fresh interpreter would (the zygote's
docstring says what it hands over). This process stays as the rank's stand-in for srun: every stop signal Slurm
sends it goes to the rank's process group (as Slurm signals every process of a step), its exit is the rank's
(the same code, or death by the same signal), and when srun kills it (SIGKILL, which no process can pass on) the
zygote's handler sees the connection close and kills the rank's group.

It also stands in for a child that multiprocessing spawns (`[-B] -c 'from multiprocessing.spawn import spawn_main;
spawn_main(...)' --multiprocessing-fork`): vLLM's engine core, about 17 of its 20 CPU-seconds in importing torch,
transformers and vLLM again. tests/cli_zygote.py names a script that runs this file as multiprocessing's
executable in the runs it forks (`spawn_python`), and a zygote started with `--on-first-request` serves those
children: the request carries the file descriptors multiprocessing passed on (the pipe the child reads its process
object from, the resource tracker's), each under its own number, and the niceness of the parent.

torchrun's workers come the same way (tests/distributed.py `torchrun` names the stand-in as torchrun's PYTHON_EXEC,
which it starts as `PYTHON_EXEC -u -m MODULE ...`: `-u` is the one flag taken there).

Anything else (other `-c CODE`, other flags, a request the zygote refuses because a variable read at import time differs,
no HPC_RLHF_TEST_ZYGOTE) execs the real interpreter with the same arguments.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_VAR = "HPC_RLHF_TEST_ZYGOTE"
# Every signal a Slurm step's tasks receive that a process can catch: stop signals (scancel --signal, --signal=SIG@T,
# the job's end), the SIGCONT that precedes a kill, and the terminal's.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM)
MAX_REPLY_BYTES = 4096
# The zygote's first answer, else a fresh interpreter (a wedged zygote must not hold the rank); a test shortens it.
START_TIMEOUT_S = 60.0
START_TIMEOUT_VAR = "HPC_RLHF_TEST_ZYGOTE_START_S"


def start_timeout_s() -> float:
    value = os.environ.get(START_TIMEOUT_VAR, str(START_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        sys.exit(f"tests/zygote_python.py: {START_TIMEOUT_VAR}={value!r} must be a number of seconds above 0")
    return seconds


def fresh_interpreter(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def request_for(argv: list[str]) -> dict | None:
    """The zygote's request for this command line, or None where only a fresh interpreter can run it."""
    unbuffered = argv[:1] == ["-u"]  # torchrun starts its workers as `PYTHON_EXEC -u ...`
    command = argv[1:] if unbuffered else argv
    if len(command) >= 2 and command[0] == "-m":
        module, script, rest = command[1], None, command[2:]
    elif command and not command[0].startswith("-"):
        module, script, rest = None, os.path.abspath(command[0]), command[1:]
    else:
        return None if unbuffered else spawn_request(argv)
    return {"module": module, "script": script, "argv": rest, "env": dict(os.environ), "cwd": os.getcwd(),
            "nice": 0, "cpus": sorted(os.sched_getaffinity(0)), "umask": _umask(), "unbuffered": unbuffered}


SPAWN_CODE = "from multiprocessing.spawn import spawn_main; spawn_main("
SPAWN_FLAG = "--multiprocessing-fork"


def spawn_request(argv: list[str]) -> dict | None:
    """The request for a child that multiprocessing spawns, or None for any other command line. `-B` is the one
    interpreter flag taken (multiprocessing passes the parent's flags on; the sandboxes set PYTHONDONTWRITEBYTECODE)."""
    flags = argv[:argv.index("-c")] if "-c" in argv else argv
    rest = argv[len(flags):]
    if any(flag != "-B" for flag in flags) or len(rest) != 3 or not rest[1].startswith(SPAWN_CODE) \
            or rest[2] != SPAWN_FLAG:
        return None
    env = dict(os.environ)
    env.pop(SOCKET_VAR, None)  # the spawn_python script's, not the parent's
    env.pop(START_TIMEOUT_VAR, None)
    return {"code": rest[1], "argv": [SPAWN_FLAG], "dont_write_bytecode": bool(flags), "env": env,
            "cwd": os.getcwd(), "priority": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
            "umask": _umask(), "fds": passed_fds()}


def passed_fds() -> list[int]:
    """The descriptors this process holds beyond the standard three: those its parent passed on."""
    listed = [int(name) for name in os.listdir("/proc/self/fd")]  # the listing's own descriptor is closed by now
    return [fd for fd in sorted(listed) if fd > 2 and is_open(fd)]


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: list[str]) -> None:
    path = os.environ.get(SOCKET_VAR)
    request = request_for(argv) if path else None
    if request is None:
        fresh_interpreter(argv)
    # Held back until the rank's pid is known, then passed on: a stop signal must never end this stand-in alone.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(start_timeout_s())
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *request.get("fds", [])])
        reply = json.loads(conn.recv(MAX_REPLY_BYTES) or b"{}")
    except (OSError, ValueError) as exc:
        print(f"tests/zygote_python.py: the zygote at {path} did not answer ({exc}); starting a fresh interpreter",
              file=sys.stderr, flush=True)
        reply = {"refused": True}
    if "pid" not in reply:  # refused (tests/cli_zygote.py names the variables in the lane's log)
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        fresh_interpreter(argv)
    rank = reply["pid"]
    for fd in request.get("fds", []):  # the child holds them now: a pipe's end closes when the child ends, as spawned
        os.close(fd)
    conn.settimeout(None)  # the rank runs as long as it runs: srun's limits apply to this stand-in

    def pass_on(signum, _frame):
        try:
            os.killpg(rank, signum)
        except ProcessLookupError:
            pass  # the rank has just ended: its exit code follows

    for signum in FORWARDED:
        signal.signal(signum, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    ended = conn.recv(MAX_REPLY_BYTES)
    if not ended:
        print(f"tests/zygote_python.py: the zygote at {path} ended before rank process {rank}", file=sys.stderr,
              flush=True)
        os._exit(1)
    code = json.loads(ended)["returncode"]
    if code < 0:  # the rank died of a signal: so does its stand-in, for srun to see the same
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
    os._exit(code & 0xFF if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
