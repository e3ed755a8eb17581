"""The CPU's ONNX Runtime engine (worker/onnx_engine.py) through a real `pollen serve --device cpu`,
against the independent references: sentence-transformers' encode for each family it runs (BERT,
RoBERTa, XLM-R, DistilBERT and MPNet, tiny random checkpoints saved by transformers and
sentence-transformers) and CrossEncoder for a reranker, in fp32; the workers that serve them never
load torch. Then the export's cache (common/onnx_cache.py): a second start finds the export, a
changed checkpoint is exported again, a read-only model folder is only read; --cpu-engine torch
runs torch; the engine choice's refusals; and the padded groups against a brute-force cut."""
from __future__ import annotations

import itertools
import json
import os
import stat
import sys

import grpc
import numpy as np
import pytest
import torch

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, vectors
from tests.st_models import BERT_VOCAB, copy_bert_tokenizer, randomize, save_st, texts

TEXTS = texts([1, 3, 8, 20, 45, 5, 12, 70, 2, 33, 9, 15, 27, 4, 60, 18, 6, 11, 40, 7], seed=3)
QUERY = "which bees make the pollen vector"
MIN_COSINE, MAX_DIFF = 0.99999, 1e-4


def hf_encoder(kind: str):
    """A tiny random HF encoder of `kind` whose vocabulary is all-MiniLM-L6-v2's tokenizer's."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=BERT_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64)
    if kind == "distilbert":
        return tf.DistilBertModel(tf.DistilBertConfig(vocab_size=BERT_VOCAB, dim=32, n_layers=2, n_heads=4,
                                                      hidden_dim=64))
    if kind in ("roberta", "xlm-roberta"):  # positions from pad_token_id + 1, one token type
        model_cls, config_cls = ((tf.RobertaModel, tf.RobertaConfig) if kind == "roberta" else
                                 (tf.XLMRobertaModel, tf.XLMRobertaConfig))
        return model_cls(config_cls(**common, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1))
    return tf.BertModel(tf.BertConfig(**common, max_position_embeddings=128))


def make_embedder(folder, kind: str, pooling: str):
    """The checkpoint in `folder` (sentence-transformers' own files) and its reference, loaded back."""
    hf = folder.parent / f"hf-{folder.name}"
    model = hf_encoder(kind)
    randomize(model)
    model.eval().save_pretrained(str(hf))
    copy_bert_tokenizer(hf)
    return save_st(folder, hf, pooling)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, reference): an embedder of each family and a BERT cross-encoder."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from tests.test_model_mpnet import make_tiny_mpnet
    from tests.test_rerank_models import make_encoder_classifier

    root = tmp_path_factory.mktemp("onnx-models")
    made = {kind: (root / kind, make_embedder(root / kind, kind, pooling))
            for kind, pooling in [("bert", "mean"), ("roberta", "cls"), ("xlm-roberta", "mean"),
                                  ("distilbert", "mean")]}
    make_tiny_mpnet(root / "mpnet", normalize=False)
    made["mpnet"] = (root / "mpnet", SentenceTransformer(str(root / "mpnet"), device="cpu"))
    make_encoder_classifier(root / "cross-encoder", "bert", ())
    made["cross-encoder"] = (root / "cross-encoder", CrossEncoder(str(root / "cross-encoder"), device="cpu"))
    return made


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """One server of every model, each on ONNX Runtime, its log kept."""
    log = tmp_path_factory.mktemp("onnx-log") / "serve.log"
    flags = [arg for folder, _ in models.values() for arg in ("--model", str(folder))]
    srv = ServerProcess(*flags, "--max-texts-per-request", "64", log=str(log)).start(timeout=60)
    try:
        yield srv, log
    finally:
        assert srv.terminate() == 0


def assert_rows_match(ours: np.ndarray, ref: np.ndarray) -> None:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= MIN_COSINE, f"row {int(cos.argmin())}: cosine {cos.min()}"
    assert np.abs(ours - ref).max() <= MAX_DIFF


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta", "distilbert", "mpnet"])
def test_each_family_equals_sentence_transformers(server, models, kind):
    """All texts in one request (a batch of many lengths: the pieces and the padded groups), then
    each alone (a query), raw and normalized."""
    srv, _ = server
    folder, reference = models[kind]
    ref = reference.encode(TEXTS, batch_size=4, convert_to_numpy=True)
    with grpc.insecure_channel(srv.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        together = vectors(stub.Embed(pb.EmbedRequest(texts=TEXTS, model=folder.name), timeout=60))
        alone = np.concatenate([vectors(stub.Embed(pb.EmbedRequest(texts=[t], model=folder.name), timeout=60))
                                for t in TEXTS[:6]])
        normalized = vectors(stub.Embed(pb.EmbedRequest(texts=TEXTS, model=folder.name, normalize=True), timeout=60))
    assert_rows_match(together, ref)
    assert_rows_match(alone, ref[:6])
    assert_rows_match(normalized, ref / np.linalg.norm(ref, axis=1, keepdims=True))
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1, atol=1e-6)


def test_a_cross_encoder_scores_as_cross_encoder(server, models):
    srv, _ = server
    folder, reference = models["cross-encoder"]
    docs = [" ".join(f"w{(7 * i + j) % 300}" for j in range(3 + 5 * (i % 6))) for i in range(30)]
    scored = reference.predict([(QUERY, d) for d in docs])
    with grpc.insecure_channel(srv.listen) as channel:
        reply = pb_grpc.EmbedderStub(channel).Rerank(
            pb.RerankRequest(query=QUERY, documents=docs, model=folder.name), timeout=60)
    ours = np.zeros(len(docs))
    for r in reply.results:
        ours[r.index] = r.score
    assert np.abs(ours - scored).max() <= MAX_DIFF
    assert np.ptp(scored) > 1e-3  # the scores differ enough to tell a wrong head


def test_every_model_runs_on_onnx_runtime_and_the_worker_never_loads_torch(server, models):
    srv, log = server
    text = log.read_text()
    for folder, _ in models.values():
        assert f"model {folder.name}: CPU engine onnx, ONNX Runtime" in text, text
    workers = srv.worker_pids()
    assert workers
    for pid in workers:
        assert not torch_mapped(pid), f"worker {pid} mapped libtorch"
    assert torch_mapped(os.getpid())  # this process imported torch: the check sees it where it is


def torch_mapped(pid: int) -> bool:
    """Whether the process maps torch's shared library (importing torch loads it)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


# ---------------------------------------------------------------- the cache

def read_only(folder) -> None:
    """The folder and its files without write permission (as root the bits stop nothing: the
    test also checks that the folder is unchanged)."""
    for path in [*folder.rglob("*"), folder]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def listing(folder) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def serve_once(folder, cache, log, *flags) -> tuple[np.ndarray, str]:
    """A server of the model with the cache `cache`: its vectors of TEXTS and its log."""
    log.write_text("")
    srv = ServerProcess("--model", str(folder), "--onnx-cache", str(cache), *flags, log=str(log)).start(timeout=60)
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            rows = vectors(pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=TEXTS), timeout=60))
        if "--cpu-engine" in flags:
            assert all(torch_mapped(pid) for pid in srv.worker_pids())
        else:
            assert not any(torch_mapped(pid) for pid in srv.worker_pids())
    finally:
        assert srv.terminate() == 0
    return rows, log.read_text()


def test_the_cache_is_reused_a_changed_checkpoint_exported_again_and_the_model_folder_only_read(tmp_path):
    from safetensors.torch import load_file, save_file
    from sentence_transformers import SentenceTransformer

    folder, cache, log = tmp_path / "tiny", tmp_path / "cache", tmp_path / "serve.log"
    reference = make_embedder(folder, "bert", "mean")
    read_only(folder)
    before = listing(folder)
    rows, text = serve_once(folder, cache, log)
    assert "exporting tiny to ONNX" in text and "CPU engine onnx" in text and "exported in" in text
    assert_rows_match(rows, reference.encode(TEXTS, convert_to_numpy=True))
    exports = sorted(p.name for p in cache.iterdir())
    assert len(exports) == 1 and not any(name.startswith(".") for name in exports)  # no work folder left

    rows_again, text = serve_once(folder, cache, log)
    assert "exporting" not in text and "its export found" in text
    np.testing.assert_array_equal(rows_again, rows)
    assert listing(folder) == before  # neither start wrote into the model's folder

    weights = folder / "model.safetensors"
    weights.chmod(0o644)
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith("attention.self.query.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    read_only(folder)
    rows, text = serve_once(folder, cache, log)
    assert "exporting tiny to ONNX" in text  # the changed weights are another key
    assert len(list(cache.iterdir())) == 2
    changed = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert_rows_match(rows, changed)

    rows, text = serve_once(folder, cache, log, "--cpu-engine", "torch")
    assert "CPU engine torch (--cpu-engine torch)" in text and "exporting" not in text
    assert_rows_match(rows, changed)


def test_a_start_that_loses_the_race_takes_the_winner_s_export(tmp_path):
    """Two starts export the same checkpoint at once: the one that renames second finds the
    winner's folder in place and takes it; no work folder is left."""
    from pollen.common import onnx_cache

    model = tmp_path / "m"
    model.mkdir()
    (model / "weights").write_bytes(b"w" * 100)
    place = onnx_cache.slot(str(tmp_path / "cache"), {"exporter": "test"}, [str(model / "weights")])

    def make(kind: str):
        def write(works: list[str]) -> list[None]:
            with open(os.path.join(works[0], "encoder.onnx"), "w") as f:
                f.write(kind)
            if kind == "loser":  # the other start finishes while this one still writes
                assert onnx_cache.fill([place], make("winner"))[0].made
            return [None]
        return write

    loser = onnx_cache.fill([place], make("loser"))[0]
    assert (loser.path, loser.made, loser.error) == (place.path, False, None)
    with open(os.path.join(place.path, "encoder.onnx")) as f:
        assert f.read() == "winner"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [os.path.basename(place.path)]
    with open(os.path.join(place.path, onnx_cache.STAMP)) as f:
        assert json.load(f)["exporter"] == "test"


# ---------------------------------------------------------------- the choice of engine

def test_the_engine_choice_says_why_and_refuses_what_onnx_cannot_run(tmp_path, caplog):
    from pollen.common.model_spec import UnsupportedModel, read_model_spec
    from pollen.server.config import ServeConfig
    from pollen.server.process import cpu_engines
    from tests.test_model_qwen3 import make_tiny_qwen3

    make_tiny_qwen3(tmp_path / "qwen3")
    spec = read_model_spec(str(tmp_path / "qwen3"))
    cfg = ServeConfig(model=str(tmp_path / "qwen3"), onnx_cache=str(tmp_path / "cache"))
    with caplog.at_level("INFO", logger="pollen"):
        cpu_engines.prepare(cfg, [spec])
    assert cfg.onnx_exports == "" and "CPU engine torch (pollen exports the BERT and MPNet families" in caplog.text
    cfg = ServeConfig(model=str(tmp_path / "qwen3"), cpu_engine="onnx")
    with pytest.raises(UnsupportedModel, match="--cpu-engine onnx is refused: .* qwen3 family"):
        cpu_engines.prepare(cfg, [spec])
    with pytest.raises(ValueError, match="--cpu-engine onnx .* needs --device cpu"):
        ServeConfig(model=str(tmp_path / "qwen3"), cpu_engine="onnx", device="cuda", devices="0")
    with pytest.raises(ValueError, match="--cpu-engine must be auto, onnx or torch"):
        ServeConfig(model=str(tmp_path / "qwen3"), cpu_engine="tensorrt")


def test_an_unwritable_cache_leaves_the_model_on_torch_and_says_why(tmp_path, caplog):
    from pollen.common.model_spec import default_model_path, read_model_spec
    from pollen.server.config import ServeConfig
    from pollen.server.process import cpu_engines

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache's folder would be: no user can write under it
    cfg = ServeConfig(onnx_cache=str(blocker / "cache"))
    with caplog.at_level("INFO", logger="pollen"):
        cpu_engines.prepare(cfg, [read_model_spec(default_model_path())])
    assert cfg.onnx_exports == "" and "CPU engine torch: its ONNX export failed" in caplog.text


# ---------------------------------------------------------------- padded groups

def brute_force_cost(lengths: list[int], run_tokens: int) -> int:
    """The least cost over every cut of the lengths, sorted longest first, into consecutive groups."""
    ordered = sorted(lengths, reverse=True)
    best = None
    for mask in itertools.product((0, 1), repeat=len(ordered) - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(mask) if cut), len(ordered)]
        cost = sum(run_tokens + (b - a) * ordered[a] for a, b in zip(bounds[:-1], bounds[1:]))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_padded_groups_hold_every_sequence_and_row_once_at_least_cost(seed):
    from pollen.worker import padded
    from pollen.worker.packed import RowSpans, pack

    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.choice([1, 2, 5, 9, 17, 30, 64, 130], size=int(rng.integers(2, 11)))]
    seqs = [rng.integers(1, 1000, n).astype(np.int32) for n in lengths]
    spans = [[(0, n)] if n < 4 else [(0, n // 2), (n // 2 + 1, n)] for n in lengths]
    batch = pack(seqs, RowSpans.of(spans))
    run_tokens = int(rng.choice([1, 16, 64]))
    groups = padded.groups(batch, run_tokens)
    cost = sum(run_tokens + g.ids.size for g in groups)
    assert cost == brute_force_cost(lengths, run_tokens)
    seen_rows = np.concatenate([g.rows for g in groups])
    assert sorted(seen_rows.tolist()) == list(range(batch.rows))
    found = []
    for g in groups:
        assert g.ids.shape == (len(g.lengths), g.lengths.max())
        for row, n in zip(g.ids, g.lengths):
            found.append(tuple(row[:n]))
            assert not row[n:].any()  # padding is zeros
        flat = g.ids.reshape(-1)
        for r, start, count in zip(g.rows, g.starts, g.counts):  # each row's span, read from the padded form
            a, b = int(batch.pool_first[r]), int(batch.pool_last[r]) + 1
            np.testing.assert_array_equal(flat[start:start + count], batch.ids[a:b])
    assert sorted(found) == sorted(tuple(s) for s in seqs)


def test_pooling_from_the_padded_output_equals_pooling_each_span():
    from pollen.worker import padded

    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((3, 7, 5)).astype(np.float32)
    starts, counts = np.array([0, 9, 16, 14, 7]), np.array([3, 4, 5, 2, 1])  # the last span ends at the end
    flat = hidden.reshape(-1, 5)
    spans = [flat[s:s + c] for s, c in zip(starts, counts)]
    np.testing.assert_allclose(padded.pool(hidden, starts, counts, "mean"), [s.mean(0) for s in spans], rtol=1e-6)
    np.testing.assert_array_equal(padded.pool(hidden, starts, counts, "max"), [s.max(0) for s in spans])
    np.testing.assert_array_equal(padded.pool(hidden, starts, counts, "cls"), [s[0] for s in spans])
    np.testing.assert_array_equal(padded.pool(hidden, starts, counts, "last"), [s[-1] for s in spans])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
