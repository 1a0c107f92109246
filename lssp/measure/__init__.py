"""Measurements: latency, bench, eval, verify, cost: each runs completions through engines."""
