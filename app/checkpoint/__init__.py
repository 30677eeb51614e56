"""Parallel-HDF5 checkpoints: save, load on any grid, commit atomically, inspect, export.

`io.py` (the file layout, save, load/reshard), `background.py` (checkpoint.async: the write on a
thread of its own), `slabs.py` (hyperslab I/O, checksums), `stages.py` (the agreed stages of a
write), `store.py` (file names, commit, `latest`, retention), `export.py` (Hugging Face GPT-2),
`__main__.py` (`python -m app.checkpoint inspect|export`). The format: docs/CHECKPOINT.md.
"""
