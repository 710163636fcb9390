"""Smoke run of ``bench sync``'s GADMM rows at a tiny size."""

from __future__ import annotations

import bench.sync as sync_bench


def test_gadmm_rows_report_rounds_and_bytes_against_allreduce() -> None:
    result = sync_bench.gadmm_rows(workers=4, rows=800, dim=6, tols=(1e-3,), max_rounds=12)
    gadmm, lbfgs = result["runs"]
    assert gadmm["name"] == "gadmm" and lbfgs["name"] == "allreduce_lbfgs"
    assert gadmm["rounds"][0] is not None and gadmm["rounds"][0] <= 12
    assert lbfgs["rounds"][0] is not None
    # a chain of 4: the two ends send to one neighbour, the middle two to two
    assert gadmm["bytes_per_round"] == (1 + 2 + 2 + 1) * 6 * 8
