"""Bulk embedding on Ray Data: each actor runs pollen's engine in-process (bulk/embedder.py).

    import ray
    from pollen.bulk.ray import PollenEmbedder, embed_dataset

    ds = ray.data.read_parquet("s3://corpus/")
    ds = embed_dataset(ds, "/models/Qwen3-Embedding-0.6B", device="cuda")   # one actor per GPU
    ds.write_parquet("s3://corpus-vectors/")

    # or by hand: map_batches with the callable class, one GPU per actor
    ds.map_batches(PollenEmbedder, fn_constructor_kwargs={"model": path, "device": "cuda"},
                   batch_format="pyarrow", batch_size=512, num_gpus=1,
                   compute=ray.data.ActorPoolStrategy(size=8))

Each actor loads the model once and embeds the batches it is given; every row keeps its other
columns and gains `output`, the vectors of its `column`, float32 and (by default) normalized:
the vectors `pollen serve` answers for the same texts. On CUDA an actor asks Ray for one GPU, and
Ray's CUDA_VISIBLE_DEVICES makes it the actor's only one. The model directory must exist on every
node. This module and `pollen bulk` (bulk/command.py) are the only ones that import Ray.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import ray
import ray.data

from pollen.bulk.embedder import BulkEmbedder


class PollenEmbedder:
    """A callable class for `Dataset.map_batches`: adds the column `output` (float32 vectors of the
    texts in `column`) to each batch. Batches may be pyarrow Tables (the vectors become a
    fixed_size_list<float32> column), pandas DataFrames or dicts of numpy arrays (a [rows, dims]
    float32 array). `options` are BulkEmbedder's (device, truncate, dimensions, normalize, ...)."""

    def __init__(self, model: str | None = None, *, column: str = "text", output: str = "embedding", **options):
        self.column, self.output = column, output
        self.embedder = BulkEmbedder(model, **options)

    def __call__(self, batch):
        if isinstance(batch, pa.Table):
            self.check_columns(batch.column_names)
            vectors = self.embed(batch.column(self.column).to_pylist())
            return batch.append_column(self.output, fixed_size_lists(vectors))
        self.check_columns(list(batch.keys()))
        vectors = self.embed(list(batch[self.column]))
        if isinstance(batch, dict):
            return {**batch, self.output: vectors}
        batch[self.output] = list(vectors)  # a pandas DataFrame: one array per row
        return batch

    def embed(self, texts: list) -> np.ndarray:
        try:
            return self.embedder.embed(texts)
        except ValueError as exc:  # the text's number is its place in this batch, not in the dataset
            raise ValueError(f"column {self.column!r} of a batch: {exc} (filter empty and null texts out "
                             "before embedding)") from None

    def check_columns(self, names: list[str]) -> None:
        if self.column not in names:
            raise ValueError(f"no column {self.column!r} to embed; the columns are {', '.join(map(str, names))}")
        if self.output in names:
            raise ValueError(f"the output column {self.output!r} exists already; name another (output=...)")


def fixed_size_lists(vectors: np.ndarray) -> pa.FixedSizeListArray:
    """[rows, dims] float32 as an Arrow column of fixed-size lists (Parquet, pandas and DuckDB read it)."""
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])


def embed_dataset(dataset: ray.data.Dataset, model: str | None = None, *, column: str = "text",
                  output: str = "embedding", device: str = "cpu", actors: int = 0, cpus_per_actor: float = 1,
                  batch_size: int = 512, **options) -> ray.data.Dataset:
    """`dataset` with the column `output` added, computed by `actors` PollenEmbedder actors (0: one per
    GPU of the cluster on cuda, one on cpu), each holding one GPU on cuda and `cpus_per_actor` CPUs
    (its torch threads on cpu). `batch_size` rows go to an actor at a time; the actor packs them
    into token-budget batches itself."""
    cuda = device == "cuda"
    if not actors:
        actors = int(ray.cluster_resources().get("GPU", 0)) if cuda else 1
        if actors < 1:
            raise ValueError("device cuda, but the Ray cluster has no GPU")
    return dataset.map_batches(
        PollenEmbedder, fn_constructor_args=(model,),
        fn_constructor_kwargs={"column": column, "output": output, "device": device, **options},
        batch_format="pyarrow", batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=1 if cuda else 0, num_cpus=cpus_per_actor)
