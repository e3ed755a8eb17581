"""SPLADE sparse embedders (BertForMaskedLM, DistilBertForMaskedLM: server/tasks/sparse_vectors.py,
worker/models/splade.py) through a real server, against the transformers recipe: the MLM logits
of every token, log(1 + relu(.)), max-pooled over the sequence (special tokens included); over
gRPC, the Python client, the OpenAI route, TEI's /embed_sparse and tei.v1 EmbedSparse (tei-client's
stubs: its clients have no sparse call); the refusals that name the field, and the CUDA refusal at
start."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.client import Client
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.st_models import copy_bert_tokenizer, randomize

TEXTS = ["the search server ranked the results", "bees", "a GPU token vector of 3.5 and 1999 e-mail"]
# The MLM bias that leaves a few dozen positive weights a row in the tiny models (a trained SPLADE
# model's rows are as sparse; a random one's would hold most of the vocabulary).
SPARSE_BIAS = -0.4


def make_splade(path, kind: str, bias: float = SPARSE_BIAS) -> str:
    import torch
    from transformers import BertConfig, BertForMaskedLM, DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(3)
    if kind == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=128)).eval()
        mlm_bias = model.cls.predictions.bias
    else:
        model = DistilBertForMaskedLM(DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                       max_position_embeddings=128)).eval()
        mlm_bias = model.vocab_projector.bias
    randomize(model)
    with torch.no_grad():
        mlm_bias.copy_(bias + 0.05 * torch.randn_like(mlm_bias))
    model.save_pretrained(str(path))
    copy_bert_tokenizer(path)
    return str(path)


def make_distilbert_head(path, tied: bool = True) -> str:
    """A DistilBertForMaskedLM whose MLM head leaves each part's mark on the weights: vocab_transform
    wide enough that the GELU's inputs reach its curved range (where the erf and tanh forms part),
    vocab_layer_norm and the biases off their init (randomize), and a word table (or an untied
    vocab_projector) wide enough that the head's differences reach the weights; the MLM bias keeps
    the rows sparse."""
    import torch
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(5)
    model = DistilBertForMaskedLM(DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                   max_position_embeddings=128, tie_word_embeddings=tied)).eval()
    randomize(model)
    decoder = model.distilbert.embeddings.word_embeddings if tied else model.vocab_projector
    with torch.no_grad():
        model.vocab_transform.weight.normal_(0, 2 / 32 ** 0.5)
        decoder.weight.normal_(0, 0.1)
        model.vocab_projector.bias.copy_(-2 + 0.05 * torch.randn_like(model.vocab_projector.bias))
    model.save_pretrained(str(path))
    copy_bert_tokenizer(path)
    return str(path)


def reference(path: str, texts: list[str]) -> list[dict[int, float]]:
    """The SPLADE recipe in transformers: {id: weight} of each text's positive weights."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            batch = tokenizer(text, return_tensors="pt")
            weights = torch.log1p(torch.relu(model(**batch).logits[0])).amax(dim=0).numpy()
            ids = np.flatnonzero(weights > 0)
            out.append(dict(zip(ids.tolist(), weights[ids].tolist())))
    return out


def save_sparse_encoder(path, hf_dir: str):
    """The checkpoint wrapped in sentence-transformers' SparseEncoder (MLMTransformer, SpladePooling
    max over relu) and saved by it; the encoder itself, the reference."""
    from sentence_transformers import SparseEncoder

    try:
        from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    except ImportError:  # sentence-transformers 5 names the package models
        from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    model = SparseEncoder(modules=[MLMTransformer(hf_dir), SpladePooling(pooling_strategy="max")], device="cpu")
    model.save(str(path))
    return model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    made = {kind: make_splade(tmp_path_factory.mktemp(f"tiny-splade-{kind}"), kind) for kind in ("bert", "distilbert")}
    # As save_pretrained leaves it: most of the vocabulary's weights positive in every row.
    made["plain"] = make_splade(tmp_path_factory.mktemp("plain-distilbert"), "distilbert", bias=0.0)
    made["st"] = str(tmp_path_factory.mktemp("tiny-sparse-encoder"))
    save_sparse_encoder(made["st"], made["bert"])
    return made


@pytest.fixture(scope="module")
def server(paths):
    srv = ServerProcess("--model", paths["bert"], "--model", paths["distilbert"], "--model", paths["st"],
                        "--model", paths["plain"], "--served-model-name", "splade,splade-distil,splade-st,plain").start()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.listen) as channel:
        yield pb_grpc.EmbedderStub(channel)


def rows_of(reply: pb.EmbedResponse) -> list[dict[int, float]]:
    assert not reply.HasField("error"), reply.error.message
    cuts = np.cumsum(reply.sparse_counts)[:-1]
    ids = np.split(np.frombuffer(reply.sparse_indices, np.uint32), cuts)
    weights = np.split(np.frombuffer(reply.sparse_values, np.float32), cuts)
    for row in ids:
        assert (np.diff(row.astype(np.int64)) > 0).all()  # ascending ids
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)]


def assert_same(ours: dict[int, float], theirs: dict[int, float], tolerance: float = 1e-4) -> None:
    assert set(ours) == set(theirs)
    assert max(abs(ours[i] - theirs[i]) for i in theirs) <= tolerance


@pytest.mark.parametrize("model, kind", [("splade", "bert"), ("splade-distil", "distilbert")])
def test_sparse_vectors_equal_the_transformers_recipe(stub, paths, model, kind):
    want = reference(paths[kind], TEXTS)
    assert all(0 < len(w) < 1024 for w in want)  # sparse, and under the row's bound
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, model=model), timeout=30)  # a sparse model's default output
    assert reply.rows == 0 and reply.embeddings == b""
    for ours, theirs in zip(rows_of(reply), want):
        assert_same(ours, theirs)
    # normalize does not apply to sparse rows; sparse_top_k keeps the largest weights.
    again = stub.Embed(pb.EmbedRequest(texts=TEXTS, model=model, normalize=True, outputs=[pb.OUTPUT_SPARSE],
                                       sparse_top_k=5), timeout=30)
    for ours, theirs in zip(rows_of(again), want):
        top = dict(sorted(theirs.items(), key=lambda kv: -kv[1])[:5])
        assert_same(ours, top)


def test_a_row_over_the_servers_width_is_refused_unless_the_largest_are_asked_for(stub, paths):
    """A text with more positive weights than an answer row holds (--sparse-max-terms, 1,024) would
    lose some: the request is refused saying so; asked for the largest, it gets exactly those."""
    want = reference(paths["plain"], TEXTS)
    assert all(len(w) > 1024 for w in want)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=TEXTS, model="plain"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("texts[0] has 1,024 or more positive vocabulary weights")
    assert "sparse_top_k" in refused.value.details() and "--sparse-max-terms" in refused.value.details()
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, model="plain", sparse_top_k=1024), timeout=30)
    for ours, theirs in zip(rows_of(reply), want):
        assert_same(ours, dict(sorted(theirs.items(), key=lambda kv: -kv[1])[:1024]))
    with pytest.raises(grpc.RpcError) as over:
        stub.Embed(pb.EmbedRequest(texts=TEXTS, model="plain", sparse_top_k=1025), timeout=30)
    assert "over the 1024 weights an answer row holds" in over.value.details()


def test_sparse_max_terms_widens_the_row_up_to_the_vocabulary(paths):
    from pollen.common.model_spec import read_model_spec
    from pollen.common.worker_config import WorkerConfig
    from pollen.server.config import ServeConfig

    assert read_model_spec(paths["plain"]).sparse_terms == 1024
    wide = read_model_spec(paths["plain"], sparse_max_terms=50_000)
    assert (wide.sparse_terms, wide.hidden_size) == (30522, 61044)  # the vocabulary, weights and ids
    cfg = ServeConfig.from_args(["--model", paths["plain"], "--sparse-max-terms", "4096"], environ={})
    assert cfg.sparse_max_terms == 4096 and "sparse_max_terms" in WorkerConfig.__dataclass_fields__  # of() copies it


def test_distilbert_mlm_head_equals_transformers(tmp_path):
    """vocab_transform, the exact GELU, vocab_layer_norm (eps 1e-12) and vocab_projector with its
    bias, tied to the word table and untied, served: the float32 recipe to within float32 rounding,
    so a tanh GELU, another eps, a norm out of place or the wrong decoder each fail it."""
    tied, untied = make_distilbert_head(tmp_path / "tied", True), make_distilbert_head(tmp_path / "untied", False)
    want = {path: reference(path, TEXTS) for path in (tied, untied)}
    assert all(0 < len(w) < 1024 for rows in want.values() for w in rows)
    srv = ServerProcess("--model", tied, "--model", untied, "--served-model-name", "tied,untied").start(timeout=60)
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            replies = {path: stub.Embed(pb.EmbedRequest(texts=TEXTS, model=name), timeout=30)
                       for name, path in (("tied", tied), ("untied", untied))}
    finally:
        assert srv.terminate() == 0
    for path, reply in replies.items():
        for ours, theirs in zip(rows_of(reply), want[path]):
            assert_same(ours, theirs, tolerance=1e-5)


def test_a_sentence_transformers_sparse_encoder_folder_equals_its_encode(stub, paths):
    from sentence_transformers import SparseEncoder

    encoded = SparseEncoder(paths["st"], device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, model="splade-st"), timeout=30)
    for ours, row in zip(rows_of(reply), encoded):
        ids = np.flatnonzero(row)
        assert_same(ours, dict(zip(ids.tolist(), row[ids].tolist())))


def test_client_openai_route_and_tei(server, paths):
    want = reference(paths["bert"], TEXTS)
    with Client(server.listen) as client:
        info = client.info()
        got = client.embed_sparse(TEXTS)
    assert [(m.sparse, m.dimensions) for m in info.models] == [(True, 30522)] * 4
    for (ids, weights), theirs in zip(got, want):
        assert_same(dict(zip(ids.tolist(), weights.tolist())), theirs)
    body = json.dumps({"input": TEXTS[:2], "outputs": ["sparse"], "model": "splade"}).encode()
    data = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/embeddings", body), timeout=30).read())["data"]
    for item, theirs in zip(data, want):
        assert "embedding" not in item
        assert_same(dict(zip(item["sparse_embedding"]["indices"], item["sparse_embedding"]["values"])), theirs)
    # TEI's route and both of tei-client's clients: the first sparse model, [{index, value}] by index.
    raw = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/embed_sparse", json.dumps({"inputs": TEXTS}).encode(),
        headers={"Content-Type": "application/json"}), timeout=30).read())
    for row, theirs in zip(raw, want):
        assert [v["index"] for v in row] == sorted(v["index"] for v in row)
        assert_same({v["index"]: v["value"] for v in row}, theirs)
    # tei.v1 EmbedSparse and its stream through tei-client's own stubs (its clients have no
    # embed_sparse call): the same entries.
    from tei_client.stubs import tei_pb2 as tei
    from tei_client.stubs import tei_pb2_grpc as tei_grpc

    with grpc.insecure_channel(server.listen) as channel:
        stub = tei_grpc.EmbedStub(channel)
        one = stub.EmbedSparse(tei.EmbedSparseRequest(inputs=TEXTS[0]), timeout=30)
        streamed = list(stub.EmbedSparseStream(iter([tei.EmbedSparseRequest(inputs=t) for t in TEXTS]), timeout=30))
    assert_same({v.index: v.value for v in one.sparse_embeddings}, want[0])
    for answer, theirs in zip(streamed, want):
        assert_same({v.index: v.value for v in answer.sparse_embeddings}, theirs)


@pytest.mark.parametrize("fields, words", [
    ({"outputs": [pb.OUTPUT_DENSE]}, "a sparse (SPLADE) model answers outputs OUTPUT_SPARSE only"),
    ({"outputs": [pb.OUTPUT_TOKENS]}, "a sparse (SPLADE) model answers outputs OUTPUT_SPARSE only"),
    ({"sparse_top_k": 0}, "sparse_top_k must be at least 1"),
    ({"dimensions": 64}, "dimensions does not apply to sparse vectors"),
    ({"encoding": pb.ENCODING_INT8}, "float32"),
], ids=["dense", "tokens", "top-k-0", "dimensions", "int8"])
def test_bad_sparse_requests_are_refused_naming_the_field(stub, fields, words):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(texts=["bees"], model="splade", **fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details(), err.value.details()
    assert rows_of(stub.Embed(pb.EmbedRequest(texts=["still answered"], model="splade"), timeout=30))


def test_http_sparse_top_k_zero_is_refused(server):
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/embeddings",
                                     json.dumps({"input": "bees", "model": "splade", "sparse_top_k": 0}).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == "sparse_top_k"


def test_tei_embed_sparse_refuses_as_tei(server):
    for body, status, error_type in (({"inputs": []}, 400, "empty"), ({"inputs": 5}, 422, "validation")):
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/embed_sparse", json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        answer = json.loads(err.value.read())
        assert err.value.code == status and set(answer) == {"error", "error_type"}, answer
        assert answer["error_type"] == error_type, answer


def test_pollen_embed_sparse(server, paths):
    from tests.test_cli_embed import pollen_embed

    done = pollen_embed(*TEXTS[:2], "--sparse", "--sparse-top-k", "4", "--server", server.listen)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)["sparse_embeddings"]
    for row, theirs in zip(got, reference(paths["bert"], TEXTS[:2])):
        assert row["indices"] == sorted(row["indices"])
        assert_same(dict(zip(row["indices"], row["values"])), dict(sorted(theirs.items(), key=lambda kv: -kv[1])[:4]))


def test_a_row_past_the_bound_keeps_its_largest_weights(tmp_path):
    """A positive MLM bias makes every vocabulary weight positive: the row holds SPARSE_TERMS
    (1,024) of its 30,522, the largest, exactly as the recipe weighs them."""
    from pollen.common.model_spec import SPARSE_TERMS
    from pollen.server.tasks.sparse_vectors import finish
    from pollen.worker.eager_engine import EagerEngine
    from pollen.worker.models.loader import load_model
    from pollen.worker.packed import pack
    from tests.st_models import token_ids

    path = make_splade(tmp_path / "dense-splade", "bert", bias=1.0)
    (want,) = reference(path, TEXTS[:1])
    assert len(want) > SPARSE_TERMS
    rows = EagerEngine(load_model(path), 1, adapt_threads=False).submit(pack(token_ids(path, TEXTS[:1]))).result()
    ids, weights, counts = finish(np.asarray(rows), SPARSE_TERMS)
    assert counts == [SPARSE_TERMS]
    largest = dict(sorted(want.items(), key=lambda kv: -kv[1])[:SPARSE_TERMS])
    assert_same(dict(zip(ids.tolist(), weights.tolist())), largest)


def test_sparse_tokens_are_the_tokenizers_strings_of_the_ids(stub, server, paths):
    """sparse_tokens: beside each id, the tokenizer's own id_to_token, over gRPC, the OpenAI route
    and the client; the ids and weights unchanged."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{paths['bert']}/tokenizer.json")
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, model="splade", sparse_tokens=True, sparse_top_k=20), timeout=30)
    ids = np.frombuffer(reply.sparse_indices, np.uint32).tolist()
    assert len(reply.sparse_tokens) == len(ids) == sum(reply.sparse_counts) > 0
    assert list(reply.sparse_tokens) == [tokenizer.id_to_token(i) for i in ids]
    plain = stub.Embed(pb.EmbedRequest(texts=TEXTS, model="splade", sparse_top_k=20), timeout=30)
    assert rows_of(plain) == rows_of(reply) and not plain.sparse_tokens
    body = json.dumps({"input": TEXTS[:2], "model": "splade", "sparse_tokens": True}).encode()
    data = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/embeddings", body), timeout=30).read())["data"]
    for item in data:
        row = item["sparse_embedding"]
        assert row["tokens"] == [tokenizer.id_to_token(i) for i in row["indices"]] and row["tokens"]
    with Client(server.listen) as client:
        got = client.embed_sparse(TEXTS, sparse_tokens=True)  # the first model: splade
    assert all(tokens == [tokenizer.id_to_token(i) for i in ids.tolist()] for ids, _, tokens in got)
