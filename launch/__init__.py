"""Launch helpers: setup, local runner, job scripts."""
