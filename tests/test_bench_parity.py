"""bench/parity.py's verdict: each configuration's mean AP against its reference's, within the larger seed spread."""

from __future__ import annotations

import pytest

from bench.parity_verdict import AP_TARGET, summarize


def rows(aps_by_config: dict[str, list[float]]) -> list[dict]:
    return [
        {"config": config, "seed": seed, "ap": ap, "ap50": min(1.0, ap + 0.4)}
        for config, aps in aps_by_config.items()
        for seed, ap in enumerate(aps)
    ]


def comparison(summary: dict, config: str) -> dict:
    (found,) = [c for c in summary["comparisons"] if c["config"] == config]
    return found


def test_a_difference_within_the_larger_spread_passes_and_one_beyond_fails():
    summary = summarize(
        rows(
            {
                "triton-eager": [0.24, 0.25, 0.26],  # mean 0.25, spread 0.02
                "triton-compiled": [0.25, 0.255, 0.26],  # mean 0.255, spread 0.01
                "pytorch-eager": [0.20, 0.21, 0.22],
            }
        )
    )  # mean 0.21, spread 0.02
    per_config = summary["per_config"]
    assert per_config["triton-eager"]["mean_ap"] == pytest.approx(0.25)
    assert per_config["triton-eager"]["spread_ap"] == pytest.approx(0.02)
    # The target is noted beside the verdict: 0.25 is met by a mean of 0.25, not by 0.21.
    assert pytest.approx(0.25) == AP_TARGET
    assert per_config["triton-eager"]["meets_ap_target"] and not per_config["pytorch-eager"]["meets_ap_target"]
    compiled = comparison(summary, "triton-compiled")
    assert compiled["reference"] == "triton-eager" and compiled["passed"]
    assert compiled["difference"] == pytest.approx(0.005) and compiled["allowed"] == pytest.approx(0.02)
    eager = comparison(summary, "triton-eager")
    assert eager["reference"] == "pytorch-eager" and not eager["passed"]
    assert eager["difference"] == pytest.approx(0.04) and eager["allowed"] == pytest.approx(0.02)


def test_the_larger_of_the_two_spreads_is_the_allowance():
    # triton-eager alone varies little; pytorch-eager's seeds spread wider than the difference of the means.
    summary = summarize(rows({"triton-eager": [0.250, 0.251], "pytorch-eager": [0.22, 0.27]}))
    eager = comparison(summary, "triton-eager")
    assert eager["allowed"] == pytest.approx(0.05) and eager["passed"]


def test_failed_runs_and_single_seeds_give_no_verdict():
    table = rows({"triton-eager": [0.25, 0.26], "pytorch-eager": [0.25]})
    table.append({"config": "pytorch-eager", "seed": 1, "failed": "exit 1, 0 evaluations"})
    summary = summarize(table)
    assert summary["per_config"]["pytorch-eager"]["runs"] == 1 and summary["per_config"]["pytorch-eager"]["failed"] == 1
    assert comparison(summary, "triton-eager")["passed"] is None, "one finished seed has no spread"
    assert comparison(summary, "triton-compiled")["passed"] is None, "not run"
