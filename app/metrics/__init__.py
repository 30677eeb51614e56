"""Metrics: FLOP formulas, the device peak table, timers and run reports."""
