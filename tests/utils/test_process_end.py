"""A process ended by hpc_rlhf.utils.process_end ends as the interpreter would end the same program: exit code,
stderr, atexit handlers, non-daemon threads, buffered output, death by SIGINT; and the command line's exit."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.distributed import REPO, worker_env

# The same program twice: ended by the interpreter (`plain`), and as run() under end_process.
PROGRAM = """
import atexit, sys, threading, time
atexit.register(print, "atexit handler ran")
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
print("buffered", end="")

def run():
    ending = sys.argv[2]
    if ending == "raise":
        raise ValueError("boom")
    if ending == "interrupt":
        raise KeyboardInterrupt
    if ending == "text":
        sys.exit("a message for the exit")
    if ending == "none":
        return None
    return int(ending)

if sys.argv[1] == "plain":
    code = run()
    sys.exit(code)
else:
    from hpc_rlhf.utils.process_end import end_process
    end_process(run)
"""


def _run(how: str, ending: str) -> subprocess.CompletedProcess:
    # PYTHONUNBUFFERED left out: the output the program buffered is flushed at its end
    return subprocess.run([sys.executable, "-c", PROGRAM, how, ending], cwd=REPO,
                          env=worker_env({"PYTHONUNBUFFERED": ""}), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("ending, code", [("0", 0), ("7", 7), ("none", 0), ("text", 1), ("raise", 1),
                                          ("interrupt", -signal.SIGINT)])
def test_a_program_ends_as_the_interpreter_would_end_it(ending, code):
    ended, plain = _run("end_process", ending), _run("plain", ending)
    assert plain.returncode == ended.returncode == code
    assert ended.stdout == plain.stdout
    assert ended.stdout.startswith("buffered") and "thread finished" in ended.stdout
    assert "atexit handler ran" in ended.stdout
    if ending in ("raise", "interrupt"):  # the program's frames, not end_process's
        assert ended.stderr.endswith(("ValueError: boom\n", "KeyboardInterrupt\n")) and "process_end" not in ended.stderr
        assert ended.stderr.count('File "<string>"') == plain.stderr.count('File "<string>"') - 1  # from run() on
    else:
        assert ended.stderr == plain.stderr


def test_the_command_line_ended_through_it_keeps_its_code_and_message():
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf", "no-such-mode"], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown mode 'no-such-mode'" in proc.stderr
