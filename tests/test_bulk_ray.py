"""`pollen bulk` on a local Ray instance: a small Parquet corpus in two files, every row embedded
exactly once with its other columns kept, the vectors equal to a real server's; and the
map_batches class on the batch formats Ray hands it."""
from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import POLLEN, cosine_rows, vectors
from tests.texts import varied_texts

pytest.importorskip("ray", reason="the Ray bulk test needs Ray: pip install 'pollen[ray]'")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")

from pollen.bulk.ray import PollenEmbedder  # noqa: E402 - after the skip: it imports Ray


def write_corpus(folder, texts: list[str]) -> list[int]:
    """Two Parquet files of rows (id, body, lang); the ids, in file order."""
    folder.mkdir()
    ids = [1000 + 7 * i for i in range(len(texts))]
    half = len(texts) // 2
    for name, part in (("a.parquet", slice(0, half)), ("b.parquet", slice(half, None))):
        pq.write_table(pa.table({"id": ids[part], "body": texts[part], "lang": [f"l{i % 3}" for i in ids[part]]}),
                       folder / name)
    return ids


def served(stub, texts) -> np.ndarray:
    return np.concatenate([vectors(stub.Embed(pb.EmbedRequest(texts=texts[i:i + 64], normalize=True,
                                                              truncate=pb.TRUNCATE_END), timeout=60))
                           for i in range(0, len(texts), 64)])


@pytest.mark.slow
def test_pollen_bulk_embeds_every_row_once_as_the_server_does(tmp_path, stub):
    texts = varied_texts(60, seed=8) + ["the end of a long text " * 300]
    ids = write_corpus(tmp_path / "in", texts)
    started = time.monotonic()
    result = subprocess.run([POLLEN, "bulk", str(tmp_path / "in"), str(tmp_path / "out"), "--column", "body",
                             "--batch-size", "16", "--max-batch-tokens", "512"],
                            capture_output=True, text=True, timeout=600)
    print(f"pollen bulk took {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["rows"] == len(texts)
    table = pq.read_table(tmp_path / "out").to_pydict()
    assert sorted(table["id"]) == ids  # every row once
    order = [ids.index(i) for i in table["id"]]
    assert [texts[i] for i in order] == table["body"] and table["lang"] == [f"l{i % 3}" for i in table["id"]]
    got = np.array(table["embedding"], dtype=np.float32)
    assert got.shape == (len(texts), 384)
    assert cosine_rows(got, served(stub, texts)[order]).min() >= 0.9999


def test_the_map_batches_class_takes_every_batch_format(stub):
    texts = ["hello", "東京 🙂", "a third text"]
    embed = PollenEmbedder(column="t")
    want = served(stub, texts)
    table = embed(pa.table({"t": texts, "k": [1, 2, 3]}))
    assert table.column_names == ["t", "k", "embedding"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), want, atol=1e-5)
    np.testing.assert_allclose(embed({"t": np.array(texts)})["embedding"], want, atol=1e-5)
    np.testing.assert_allclose(np.stack(embed(pd.DataFrame({"t": texts}))["embedding"]), want, atol=1e-5)
    with pytest.raises(ValueError, match="no column 'text'"):
        PollenEmbedder()(pa.table({"t": texts}))
    with pytest.raises(ValueError, match="exists already"):
        embed(pa.table({"t": texts, "embedding": [0, 0, 0]}))


@pytest.mark.slow
def test_pollen_bulk_names_a_bad_text_and_fails(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["fine", "", "fine too"]}), folder / "a.parquet")
    result = subprocess.run([POLLEN, "bulk", str(folder), str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "pollen bulk: failed: ValueError: column 'text' of a batch: text 1 (of 3) is empty: every text needs at "
        "least one character (filter empty and null texts out before embedding)")
    refused = subprocess.run([POLLEN, "bulk", str(folder), str(folder)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "is not empty" in refused.stderr  # never writes into a full folder
