"""benchmarks/long_context.py: the table of docs/planner.md ("Long contexts") is what the script prints from the
memory model, and what it says holds for the planner's check."""

from __future__ import annotations

from hpc_rlhf.utils.imports import import_target

from tests.distributed import REPO


def test_the_docs_table_is_what_the_script_prints_and_the_lengths_fit_from_the_k_it_says(capsys):
    script = import_target(str(REPO / "benchmarks" / "long_context.py"), "benchmark_")
    assert script.main([]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed in (REPO / "docs" / "planner.md").read_text()
    fits = {(length, k): script.figures(length, k)["fits"] for length in (8192, 32768, 65536) for k in (1, 2, 4, 8)}
    smallest = {length: min(k for (n, k), ok in fits.items() if n == length and ok) for length in (8192, 32768, 65536)}
    assert smallest == {8192: 1, 32768: 2, 65536: 4}
    assert all(fits[(length, k)] for length, least in smallest.items() for k in (1, 2, 4, 8) if k >= least)
