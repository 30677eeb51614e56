"""Optimizers, learning-rate schedules and grid-aware gradient clipping."""
