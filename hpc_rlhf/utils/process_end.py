"""A process of hpc_rlhf ends as the interpreter ends one, without the interpreter's teardown of its modules.

At its end Python frees every object of every module: torch's, transformers', deepspeed's, hundreds of thousands of
them, about 2 CPU-seconds for a rank started fresh and 3 for one forked from a process that imported them (each
freed object's page is written, so a forked rank first copies it), measured on a 2-core AMD EPYC VM (2026-11-29). It
only returns memory the kernel takes back anyway. `end_process` does the rest of what the interpreter does at the
end, in its order, and leaves by `os._exit`: the code of a `SystemExit` (its text on stderr when it is not a
number), the traceback of any other exception and code 1, the non-daemon threads waited for, the atexit handlers
(the watchdog's stop, weakref finalizers such as vLLM's engine shutdown, logging's flush), MPI finalized where
mpi4py started it, the standard streams flushed, and an uncaught KeyboardInterrupt ended by SIGINT, as Python does,
for the parent to see.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

from hpc_rlhf.utils import console


def end_process(run: Callable[[], int | None], hidden_frames: Callable[[str], bool] = lambda filename: False
                ) -> NoReturn:
    """Run `run()` and end the process with its code (None: 0). `hidden_frames(filename)`: frames at the top of a
    traceback that are the caller's machinery rather than the program's (a traceback then starts where the program's
    own code does, as a fresh interpreter's would); this function's own frame is always left out."""
    code, interrupted = 1, False
    try:
        try:
            code = run()
            code = 0 if code is None else int(code)
        except SystemExit as exc:
            if exc.code is not None and not isinstance(exc.code, int):
                console.say(str(exc.code))
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # noqa: BLE001 - as the interpreter ends on any exception
            frames = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            while frames is not None and hidden_frames(frames.tb_frame.f_code.co_filename):
                frames = frames.tb_next
            console.close_progress_bars()
            sys.excepthook(type(exc), exc.with_traceback(frames), frames)
            code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        _finalize_mpi()
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # closed or detached: nothing of ours is waiting in it
                    pass
        finally:
            if interrupted:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code & 0xFF)


def _finalize_mpi() -> None:
    """mpi4py finalizes MPI in the interpreter's teardown (a C-level exit hook, not an atexit handler); mpirun counts
    a rank that never finalized as failed and ends the job with it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and sys.modules["mpi4py"].rc.finalize is not False and mpi.Is_initialized() \
            and not mpi.Is_finalized():
        mpi.Finalize()
