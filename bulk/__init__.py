"""Embedding a corpus with pollen's engine in-process, without a server: `embedder.py` (texts in,
the server's vectors out), `ray.py` (a callable class for Ray Data's map_batches, one model per
actor) and `command.py` (`pollen bulk IN OUT`: Parquet in, Parquet out, on a local Ray instance).

Ray is an optional extra (`pip install 'pollen[ray]'`) imported only by `ray.py` and `command.py`.
"""
