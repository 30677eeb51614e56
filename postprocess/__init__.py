"""Post-processing of run reports into tables and plots.

scaling.py  weak- and strong-scaling tables (CSV, Markdown, JSON) and figures from the
            summary.json / metrics.jsonl of many runs or a study manifest
compare.py  a study next to published numbers (e.g. inputs/published/) on the same axes

A run's summary.json is read through app.metrics.summary.Summary, the one module of app
that postprocess imports (standard library only: no torch here).
"""
