import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hpc_rlhf.utils import faults
from hpc_rlhf.utils.faults import FAULT_ENV, Fault, InjectedFault, parse


def test_parse_one_fault_with_every_key():
    assert parse("rank=3,phase=scoring,step=2,kind=kill") == [Fault("kill", 3, "scoring", 2, 2)]


def test_parse_several_faults_and_step_forms():
    got = parse("kind=raise,step=2-4 ; kind=freeze,rank=1,step=5+; kind=kill,step=*")
    assert got == [Fault("raise", None, None, 2, 4), Fault("freeze", 1, None, 5, None),
                   Fault("kill", None, None, None, None)]


def test_nan_faults_belong_to_the_training_phase():
    assert parse("kind=nan,rank=0,step=3") == [Fault("nan", 0, "training", 3, 3)]


@pytest.mark.parametrize("text, message", [
    ("rank=1,phase=scoring", "has no kind"),
    ("kind=explode", "kind 'explode' is not one of kill, raise, freeze, hang, nan"),
    ("kind=kill,rnak=1", "unknown key 'rnak'; did you mean 'rank'?"),
    ("kind=kill,rank=one", "rank='one' is not a whole number"),
    ("kind=kill,step=4-2", "step range '4-2' ends before it starts"),
    ("kind=kill,step=-1", "step='-1' is not N, N-M, N+ or *"),
    ("kind=kill,rank", "'rank' is not of the form key=value"),
    ("kind=kill,kind=raise", "'kind' is given twice"),
    ("kind=nan,phase=scoring", "its phase is 'training', not 'scoring'"),
])
def test_bad_specs_name_the_variable_and_the_part(text, message):
    with pytest.raises(ValueError) as info:
        parse(text)
    assert str(info.value).startswith(f"{FAULT_ENV}='{text}': ")
    assert message in str(info.value)


def test_matching_by_rank_phase_and_step():
    fault = Fault("raise", 2, "scoring", 3, None)
    assert fault.matches(2, "scoring", 3) and fault.matches(2, "scoring", 9)
    assert not fault.matches(1, "scoring", 3)
    assert not fault.matches(2, "training", 3)
    assert not fault.matches(2, "scoring", 2)


def test_describe_round_trips_through_parse():
    for text in ("kind=kill,rank=3,phase=scoring,step=2", "kind=raise,step=2-4", "kind=freeze,step=5+",
                 "kind=nan,phase=training"):
        assert parse(parse(text)[0].describe()) == parse(text)


def test_point_raises_only_where_the_fault_matches(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "rank=1,phase=scoring,step=2,kind=raise")
    faults.point("scoring", 2, rank=0)
    faults.point("training", 2, rank=1)
    faults.point("scoring", 1, rank=1)
    with pytest.raises(InjectedFault, match="rank 1, phase scoring, step 2"):
        faults.point("scoring", 2, rank=1)


def test_faults_follow_the_variable_and_none_is_left_once_it_is_unset(monkeypatch):
    loss = torch.tensor(1.0)
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=2,kind=raise;rank=1,step=2,kind=nan")
    assert faults.matching("scoring", 2, rank=1) is not None
    assert torch.isnan(faults.poison(loss, 2, rank=1))
    monkeypatch.delenv(FAULT_ENV)
    assert faults.active() == []
    assert faults.matching("scoring", 2, rank=1) is None
    faults.point("scoring", 2, rank=1)  # raises InjectedFault if the parsed faults outlived the variable
    assert faults.poison(loss, 2, rank=1) is loss


def test_poison_makes_the_loss_and_its_gradient_nan_at_the_chosen_steps(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kind=nan,rank=1,step=2-3")
    weight = torch.tensor([2.0], requires_grad=True)
    loss = (weight * 3).sum()
    assert faults.poison(loss, 1, rank=1) is loss
    assert faults.poison(loss, 2, rank=0) is loss
    poisoned = faults.poison(loss, 3, rank=1)
    assert torch.isnan(poisoned)
    poisoned.backward()
    assert torch.isnan(weight.grad).all()


def test_the_rank_comes_from_the_environment_outside_a_world(monkeypatch):
    # Other test modules may have left an in-process world behind; this case is about having none.
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv(FAULT_ENV, "rank=5,kind=raise")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(InjectedFault):
        faults.point("rollout", 0)
    monkeypatch.setenv("RANK", "4")
    faults.point("rollout", 0)


def _run_point(kind: str) -> subprocess.Popen:
    code = ("from hpc_rlhf.utils import faults; faults.point('scoring', 2, rank=0); "
            "print('survived', flush=True)")
    env = dict(os.environ, **{FAULT_ENV: f"kind={kind},phase=scoring,step=2"})
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_kill_ends_the_process_with_sigkill():
    proc = _run_point("kill")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert "injected fault" in out and "survived" not in out


def test_freeze_stops_the_process_until_it_is_continued():
    proc = _run_point("freeze")
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline and state != "T":
        time.sleep(0.1)
        with open(f"/proc/{proc.pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    assert state == "T", "the process did not stop itself"
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "survived" in out


def test_hang_ignores_the_stop_signals_and_slurms_sigcont_until_killed():
    proc = _run_point("hang")
    try:
        line = proc.stdout.readline()  # printed once the stop signals are ignored
        assert "injected fault (HPC_RLHF_FAULT: kind=hang" in line
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGCONT):  # what Slurm sends a job it ends
            os.kill(proc.pid, sig)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
    finally:
        proc.kill()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in out


def test_stop_sends_this_process_sigusr1_and_goes_on(monkeypatch):
    """The stop kind is Slurm's --signal at a chosen step: the stop handlers see SIGUSR1 and the rank carries on
    to the step's end (where the ranks agree to checkpoint and exit)."""
    from hpc_rlhf.runtime.checkpointing import StopSignal

    previous = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        stop = StopSignal()
        monkeypatch.setenv(FAULT_ENV, "kind=stop,phase=training,step=3")
        faults.point("training", 2, rank=0)
        assert stop.received is None
        faults.point("training", 3, rank=0)
        assert stop.received == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
