"""Parallel-HDF5 checkpoints: save, load on any grid, commit atomically, inspect, export.

`io.py` (the file layout, save, load/reshard), `slabs.py` (hyperslab I/O, checksums),
`store.py` (file names, commit, `latest`, retention), `export.py` (Hugging Face GPT-2),
`__main__.py` (`python -m app.checkpoint inspect|export`). The format: docs/CHECKPOINT.md.
"""
