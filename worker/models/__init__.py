"""Embedding models: our own packed (no padding) implementations loading HF safetensors directories.

Keep this file free of torch imports: the frontend imports `worker.models.spec` at start-up and
must stay light. Import the engine pieces from their modules (`worker.models.loader`).
"""
