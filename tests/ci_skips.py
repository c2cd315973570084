"""With CI=true, a skip of a test that the CI machine can run fails the run (tests/conftest.py loads these hooks).

The local Slurm tests (marker `cluster`), the MPI tests (`mpi`), the vLLM tests (`vllm`) and the documentation
build (`docs`) skip when their component is missing, which on a developer's machine is a fact worth a line, but in
CI means the claim they check was never checked: `make test` installs Open MPI and mpi4py, the vLLM CPU build and
mkdocs (the `docs` extra), and brings the local Slurm up, so in CI a skip of theirs is a failure. The one skip they may take anywhere is the CUDA one: a test
marked `cuda` needs a CUDA GPU and is skipped without one (every CI machine here is CPU-only).
"""

from __future__ import annotations

import os

import pytest

MUST_RUN_MARKERS = ("cluster", "mpi", "vllm", "docs")
CUDA_MARKER = "cuda"


def in_ci(environ=os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def must_run(markers: set[str]) -> str | None:
    """The marker that forbids a skip in CI, or None (a test marked `cuda` may always skip)."""
    if CUDA_MARKER in markers:
        return None
    return next((m for m in MUST_RUN_MARKERS if m in markers), None)


def pytest_configure(config):
    for name, text in (("mpi", "needs Open MPI and mpi4py (make venv installs them); a skip fails CI"),
                       ("vllm", "runs vLLM (its CPU build here); a skip fails CI"),
                       ("docs", "builds the documentation site with mkdocs (the docs extra); a skip fails CI"),
                       (CUDA_MARKER, "needs a CUDA GPU: skipped without one, the only skip CI accepts from a "
                                     "cluster, mpi or vllm test")):
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_runtest_setup(item):
    if item.get_closest_marker(CUDA_MARKER):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    marker = must_run({m.name for m in item.iter_markers()})
    if marker is None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"CI=true: this `{marker}` test was skipped ({reason}), but CI must run it: make test "
                       f"installs what it needs (tests/ci_skips.py)")
