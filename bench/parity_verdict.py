"""bench/parity.py's verdict: does a way of running the model reach the same converged AP as its reference?

Pass criterion, per comparison: |mean AP of the configuration - mean AP of its reference| <= the larger of the
two configurations' AP spreads (max - min over each one's seeds), i.e. within the seed-to-seed variation that
either shows by itself. Beside it, the target of a mean AP >= AP_TARGET for each configuration.
"""

from __future__ import annotations

import statistics

AP_TARGET = 0.25
# (configuration, its reference): the pairs the pass criterion compares.
COMPARISONS = (
    ("triton-eager", "pytorch-eager"),
    ("triton-compiled", "triton-eager"),
    ("triton-graphs", "triton-eager"),
)


def summarize(rows: list[dict]) -> dict:
    """Per configuration: runs, mean and spread of AP and AP50; then the criterion for each comparison.

    rows: one per run, {"config", "seed", "ap", "ap50"}, or {"config", "seed", "failed": why}.
    """
    per_config = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        done = [r for r in rows if r["config"] == config and "failed" not in r]
        aps, ap50s = [r["ap"] for r in done], [r["ap50"] for r in done]
        per_config[config] = {
            "runs": len(done),
            "failed": sum(1 for r in rows if r["config"] == config) - len(done),
            "mean_ap": statistics.fmean(aps) if aps else None,
            "spread_ap": max(aps) - min(aps) if aps else None,
            "mean_ap50": statistics.fmean(ap50s) if ap50s else None,
            "spread_ap50": max(ap50s) - min(ap50s) if ap50s else None,
            "meets_ap_target": bool(aps) and statistics.fmean(aps) >= AP_TARGET,
        }
    comparisons = []
    for config, reference in COMPARISONS:
        a, b = per_config.get(config), per_config.get(reference)
        if not a or not b or a["runs"] < 2 or b["runs"] < 2:
            comparisons.append(
                {
                    "config": config,
                    "reference": reference,
                    "passed": None,
                    "why": "not run, or fewer than 2 finished seeds for one of them: no spread",
                }
            )
            continue
        difference = abs(a["mean_ap"] - b["mean_ap"])
        allowed = max(a["spread_ap"], b["spread_ap"])
        comparisons.append(
            {
                "config": config,
                "reference": reference,
                "difference": difference,
                "allowed": allowed,
                "passed": difference <= allowed,
            }
        )
    return {"per_config": per_config, "comparisons": comparisons}
