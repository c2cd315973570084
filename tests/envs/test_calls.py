"""Concurrent environment calls: the bound holds, outcomes keep their order, a slow call is given up at its
timeout without holding up the others."""

import threading
import time

import pytest

from hpc_rlhf.envs.calls import run_calls


def test_at_most_max_concurrency_calls_run_at_once_and_outcomes_keep_their_order():
    lock, running, peak = threading.Lock(), [0], [0]

    def call(i):
        def run():
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            return i * i
        return run

    started = time.perf_counter()
    outcomes = run_calls([call(i) for i in range(10)], max_concurrency=4, timeout_s=5)
    assert [o.value for o in outcomes] == [i * i for i in range(10)] and all(o.ok for o in outcomes)
    assert peak[0] == 4
    assert 0.15 <= time.perf_counter() - started < 0.6  # ceil(10 / 4) = 3 rounds of 0.05 s
    assert all(o.seconds >= 0.05 for o in outcomes)
    assert run_calls([call(i) for i in range(3)], max_concurrency=1, timeout_s=5)[2].value == 4
    assert peak[0] == 4 and run_calls([], 2, 1) == []


def test_errors_are_returned_and_a_call_past_its_timeout_is_given_up():
    release = threading.Event()

    def hangs():
        release.wait(10)
        return "late"

    def raises():
        raise KeyError("k")

    started = time.perf_counter()
    try:
        outcomes = run_calls([hangs, raises, lambda: 3, hangs, lambda: 4], max_concurrency=2, timeout_s=0.2)
    finally:
        release.set()
    elapsed = time.perf_counter() - started
    assert [o.timed_out for o in outcomes] == [True, False, False, True, False]
    assert isinstance(outcomes[1].error, KeyError) and not outcomes[1].ok
    assert [outcomes[2].value, outcomes[4].value] == [3, 4] and outcomes[0].value is None
    assert 0.2 <= outcomes[0].seconds < 0.5
    assert elapsed < 0.7  # the two hung calls were given up, each after 0.2 s; the others did not wait for them


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        run_calls([lambda: 1], 0, 1)
