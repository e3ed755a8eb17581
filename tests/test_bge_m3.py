"""BGE-M3 (an XLM-R encoder with FlagEmbedding's sparse_linear.pt and colbert_linear.pt beside it:
server/tasks/bge_m3.py, worker/models/bge_m3.py) through a real server, against FlagEmbedding's recipe
written out here with HF transformers' XLMRobertaModel in float32 (FlagEmbedding itself does not
install here): dense = the normalized CLS state; sparse = relu(sparse_linear(h)) max-pooled per
token id, the cls, eos, pad and unk ids dropped; ColBERT = the normalized colbert_linear(h) of
every token after the first. Over gRPC, the OpenAI route, the Python client, the CLI and TEI's
routes; one forward pass for any subset of the outputs; the refusals; a folder whose heads torch
cannot read with weights_only refused at start."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from pollen.client import Client
from pollen.common.model_spec import read_model_spec
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, cosine_rows, free_port, vectors
from tests.test_metrics import delta, scrape

HIDDEN = 64
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
WORDS = ["the", "bees", "search", "server", "ranked", "results", "token", "vector", "honey", "hive", "query",
         "pollen", "flower", "field", "late", "interaction", "sparse", "dense", "of", "and"] + \
        [f"w{i}" for i in range(200)]
# Mixed lengths, repeated words (one id at several positions: the sparse max) and a word outside
# the vocabulary (<unk>, which the sparse vector drops).
TEXTS = ["bees", "the bees of the hive make honey and the bees guard the hive",
         "a search server ranked the results " + " ".join(f"w{i}" for i in range(30)),
         "late interaction of token vectors, sparse and dense"]
MAX_TOKEN_VECTORS = 160


def save_tokenizer(path) -> None:
    """A word-level tokenizer with XLM-R's special tokens and ids (<s> 0, <pad> 1, </s> 2, <unk> 3),
    each text wrapped as XLM-R's is: <s> text </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                            sep_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=64,
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(str(path))


def make_bge_m3(path) -> str:
    """A tiny random bge-m3 folder: XLMRobertaModel, sentence-transformers' module files (CLS pooling,
    Normalize) and the two heads' state dicts, as FlagEmbedding saves them."""
    import transformers as tf

    from load.m3_models import write_sentence_transformers_files
    from tests.st_models import randomize

    torch.manual_seed(7)
    model = tf.XLMRobertaModel(tf.XLMRobertaConfig(
        vocab_size=len(SPECIALS) + len(WORDS), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=66, pad_token_id=1, type_vocab_size=1)).eval()
    randomize(model)
    model.save_pretrained(str(path))
    save_tokenizer(path)
    write_sentence_transformers_files(str(path), HIDDEN)
    sparse, colbert = torch.nn.Linear(HIDDEN, 1), torch.nn.Linear(HIDDEN, HIDDEN)
    with torch.no_grad():
        sparse.bias.fill_(0.05)  # about half the tokens weigh more than 0
    torch.save(sparse.state_dict(), os.path.join(path, "sparse_linear.pt"))
    torch.save(colbert.state_dict(), os.path.join(path, "colbert_linear.pt"))
    return str(path)


def reference(path: str, texts: list[str]) -> list[dict]:
    """FlagEmbedding's BGEM3 outputs, one padded batch through HF's XLMRobertaModel in float32:
    {"dense": [H], "sparse": {id: weight}, "colbert": [n - 1, H]} per text."""
    from transformers import AutoTokenizer, XLMRobertaModel

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = XLMRobertaModel.from_pretrained(path).eval()
    sparse_linear, colbert_linear = torch.nn.Linear(HIDDEN, 1), torch.nn.Linear(HIDDEN, HIDDEN)
    sparse_linear.load_state_dict(torch.load(os.path.join(path, "sparse_linear.pt"), weights_only=True))
    colbert_linear.load_state_dict(torch.load(os.path.join(path, "colbert_linear.pt"), weights_only=True))
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        h = model(**batch).last_hidden_state
        dense = torch.nn.functional.normalize(h[:, 0], dim=-1)
        weights = torch.relu(sparse_linear(h)).squeeze(-1)
        colbert = colbert_linear(h[:, 1:]) * batch["attention_mask"][:, 1:, None].float()
    out = []
    for i in range(len(texts)):
        n = int(batch["attention_mask"][i].sum())
        lexical: dict[int, float] = {}
        for w, idx in zip(weights[i, :n].tolist(), batch["input_ids"][i, :n].tolist()):
            if idx not in unused and w > 0 and w > lexical.get(idx, 0):
                lexical[idx] = w
        vecs = torch.nn.functional.normalize(colbert[i, :n - 1], dim=-1)
        out.append({"dense": dense[i].numpy(), "sparse": lexical, "colbert": vecs.numpy()})
    return out


@pytest.fixture(scope="module")
def m3_path(tmp_path_factory):
    return make_bge_m3(tmp_path_factory.mktemp("tiny-bge-m3"))


@pytest.fixture(scope="module")
def want(m3_path):
    return reference(m3_path, TEXTS)


@pytest.fixture(scope="module")
def server(m3_path):
    srv = ServerProcess("--model", m3_path, "--served-model-name", "m3", "--max-token-vectors",
                        str(MAX_TOKEN_VECTORS)).start()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.listen) as channel:
        yield pb_grpc.EmbedderStub(channel)


def sparse_rows(reply: pb.EmbedResponse) -> list[dict[int, float]]:
    cuts = np.cumsum(reply.sparse_counts)[:-1]
    ids = np.split(np.frombuffer(reply.sparse_indices, np.uint32), cuts)
    weights = np.split(np.frombuffer(reply.sparse_values, np.float32), cuts)
    for row in ids:
        assert (np.diff(row.astype(np.int64)) > 0).all()  # ascending ids
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)]


def colbert_rows(reply: pb.EmbedResponse) -> list[np.ndarray]:
    rows = np.frombuffer(reply.token_embeddings, np.float32).reshape(-1, reply.dims)
    return np.split(rows, np.cumsum(reply.token_counts)[:-1])


def assert_sparse_same(ours: dict[int, float], theirs: dict[int, float]) -> None:
    assert set(ours) == set(theirs)
    assert max((abs(ours[i] - theirs[i]) for i in theirs), default=0) <= 1e-4


def assert_all_match(dense, sparse, colbert, want) -> None:
    assert cosine_rows(np.asarray(dense), np.stack([w["dense"] for w in want])).min() >= 0.99999
    for ours, theirs in zip(sparse, want):
        assert_sparse_same(ours, theirs["sparse"])
    for ours, theirs in zip(colbert, want):
        assert ours.shape == theirs["colbert"].shape
        assert cosine_rows(ours, theirs["colbert"]).min() >= 0.99999
        assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_the_folder_is_read_as_bge_m3(m3_path):
    spec = read_model_spec(m3_path)
    assert (spec.bge_m3, spec.sparse, spec.pooling, spec.hidden_size) == (True, True, "cls", HIDDEN)
    assert spec.output_dims == 2 * HIDDEN + 1
    assert spec.sparse_skip_ids == (0, 1, 2, 3)  # <s>, <pad>, </s>, <unk>


def test_the_reference_texts_exercise_the_recipe(m3_path, want):
    """The unknown word is <unk>, a repeated word's id has several positions, the longer texts keep
    weights and drop others (weights of 0), and the one-word text keeps none (an empty row)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(m3_path)(TEXTS)["input_ids"]
    assert 3 in ids[3] and len(set(ids[1])) < len(ids[1])
    kept = [len(w["sparse"]) for w in want]
    words = [len(set(i) - set(range(len(SPECIALS)))) for i in ids]
    assert kept[0] == 0 and all(0 < k < n for k, n in zip(kept[1:], words[1:])), (kept, words)


def test_dense_sparse_and_colbert_from_one_request_equal_flagembedding(stub, want):
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True,
                                       outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_TOKENS]), timeout=30)
    assert reply.dims == HIDDEN and reply.rows == len(TEXTS)
    assert list(reply.token_counts) == [len(w["colbert"]) for w in want]  # n - 1 a text
    assert_all_match(vectors(reply), sparse_rows(reply), colbert_rows(reply), want)


def test_each_output_alone_and_the_plain_dense_request(stub, want):
    dense = vectors(stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True), timeout=30))  # the pooled path
    assert dense.shape == (len(TEXTS), HIDDEN)
    assert cosine_rows(dense, np.stack([w["dense"] for w in want])).min() >= 0.99999
    assert np.allclose(np.linalg.norm(dense, axis=1), 1.0, atol=1e-5)
    raw = vectors(stub.Embed(pb.EmbedRequest(texts=TEXTS[:1]), timeout=30))  # not normalized: the CLS state
    assert cosine_rows(raw, want[0]["dense"][None]).min() >= 0.99999 and abs(np.linalg.norm(raw) - 1) > 1e-3
    sparse = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.OUTPUT_SPARSE]), timeout=30)
    assert sparse.rows == 0 and not sparse.token_counts
    for ours, theirs in zip(sparse_rows(sparse), want):
        assert_sparse_same(ours, theirs["sparse"])
    tokens = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.OUTPUT_TOKENS]), timeout=30)
    assert tokens.rows == 0 and not tokens.sparse_counts
    for ours, theirs in zip(colbert_rows(tokens), want):
        assert cosine_rows(ours, theirs["colbert"]).min() >= 0.99999
    top = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.OUTPUT_SPARSE], sparse_top_k=3), timeout=30)
    for ours, theirs in zip(sparse_rows(top), want):
        assert_sparse_same(ours, dict(sorted(theirs["sparse"].items(), key=lambda kv: -kv[1])[:3]))


def test_dimensions_cut_dense_and_colbert(stub, want):
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS[:2], dimensions=32, normalize=True,
                                       outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_TOKENS]), timeout=30)
    assert reply.dims == 32
    plain = vectors(stub.Embed(pb.EmbedRequest(texts=TEXTS[:2], dimensions=32, normalize=True), timeout=30))
    assert cosine_rows(vectors(reply), plain).min() >= 0.99999
    for ours, theirs in zip(colbert_rows(reply), want):
        assert cosine_rows(ours, theirs["colbert"][:, :32]).min() >= 0.99999
        assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # the cut vectors normalized again


def test_token_ids_give_the_same_answers(stub, m3_path, want):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(m3_path)(TEXTS)["input_ids"]
    reply = stub.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=i) for i in ids], normalize=True,
                                       outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_TOKENS]), timeout=30)
    assert_all_match(vectors(reply), sparse_rows(reply), colbert_rows(reply), want)


def test_the_openai_route_the_client_and_info(server, want):
    body = {"input": TEXTS, "model": "m3", "outputs": ["dense", "sparse", "tokens"], "sparse_tokens": True}
    data = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/embeddings", json.dumps(body).encode()), timeout=30).read())["data"]
    assert [item["index"] for item in data] == list(range(len(TEXTS)))
    assert_all_match([item["embedding"] for item in data],
                     [dict(zip(i["sparse_embedding"]["indices"], i["sparse_embedding"]["values"])) for i in data],
                     [np.array(item["token_embeddings"]) for item in data], want)
    vocab = SPECIALS + WORDS
    for item in data:
        assert item["sparse_embedding"]["tokens"] == [vocab[i] for i in item["sparse_embedding"]["indices"]]
    with Client(server.listen) as client:
        info = client.info()
        sparse = client.embed_sparse(TEXTS, sparse_tokens=True)
        colbert = client.embed_tokens(TEXTS)
        dense = client.embed(TEXTS)
    (model,) = info.models
    assert (model.name, model.sparse, model.dimensions, info.dimensions) == ("m3", True, HIDDEN, HIDDEN)
    assert_all_match(dense, [dict(zip(i.tolist(), w.tolist())) for i, w, _ in sparse], colbert, want)
    assert all(t == [vocab[i] for i in ids.tolist()] for ids, _, t in sparse)
    models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v1/models", timeout=30).read())
    assert models["data"][0]["id"] == "m3"


def test_tei_routes(server, want):
    def post(route: str, body: dict):
        return json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}{route}", json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}), timeout=30).read())

    for row, theirs in zip(post("/embed_sparse", {"inputs": TEXTS}), want):
        assert_sparse_same({v["index"]: v["value"] for v in row}, theirs["sparse"])
    for rows, theirs in zip(post("/embed_all", {"inputs": TEXTS}), want):
        assert cosine_rows(np.array(rows), theirs["colbert"]).min() >= 0.99999
    dense = post("/", {"inputs": TEXTS})  # an embedder's default route: dense vectors
    assert cosine_rows(np.array(dense), np.stack([w["dense"] for w in want])).min() >= 0.99999
    from tei_client.stubs import tei_pb2 as tei
    from tei_client.stubs import tei_pb2_grpc as tei_grpc

    with grpc.insecure_channel(server.listen) as channel:
        one = tei_grpc.EmbedStub(channel).EmbedSparse(tei.EmbedSparseRequest(inputs=TEXTS[1]), timeout=30)
    assert_sparse_same({v.index: v.value for v in one.sparse_embeddings}, want[1]["sparse"])


def test_pollen_embed_sparse_tokens(server, want):
    from tests.test_cli_embed import pollen_embed

    done = pollen_embed(*TEXTS[:2], "--sparse", "--sparse-tokens", "--server", server.listen)
    assert done.returncode == 0, done.stderr
    vocab = SPECIALS + WORDS
    for row, theirs in zip(json.loads(done.stdout)["sparse_embeddings"], want):
        assert_sparse_same(dict(zip(row["indices"], row["values"])), theirs["sparse"])
        assert row["tokens"] == [vocab[i] for i in row["indices"]]


def worker_batches(server) -> float:
    return scrape(server).get(("pollen_worker_batches_total", (("worker", "0"),)), 0.0)


def test_one_request_for_every_output_runs_the_model_once(server, stub):
    """The worker's batch counter (/metrics, pollen_worker_batches_total) moves by one for one
    request asking dense, sparse and ColBERT vectors, sent alone: one forward pass."""
    time.sleep(1.5)  # the worker publishes its count at each turn of its loop, at least once a second
    before = scrape(server)
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_TOKENS]),
                       timeout=30)
    assert reply.rows == len(TEXTS) and reply.sparse_counts and reply.token_counts
    time.sleep(1.5)
    after = scrape(server)
    assert delta(before, after, "pollen_worker_batches_total", worker="0") == 1


@pytest.mark.parametrize("fields, words", [
    ({"outputs": [pb.OUTPUT_SPARSE], "sparse_top_k": 0}, "sparse_top_k must be at least 1"),
    ({"outputs": [42]}, "outputs holds 42"),
    ({"sparse_tokens": True}, "sparse_tokens applies to outputs OUTPUT_SPARSE only"),
    ({"outputs": [pb.OUTPUT_TOKENS], "sparse_tokens": True}, "sparse_tokens applies to outputs OUTPUT_SPARSE"),
    ({"sparse_top_k": 4}, "sparse_top_k applies to outputs OUTPUT_SPARSE only"),
    ({"outputs": [pb.OUTPUT_SPARSE], "encoding": pb.ENCODING_INT8}, "float32"),
    ({"outputs": [pb.OUTPUT_SPARSE], "dimensions": 32}, "dimensions does not apply to sparse vectors"),
    ({"texts": [" ".join(["bees"] * 50)] * 4, "outputs": [pb.OUTPUT_SPARSE]},
     f"over the server's --max-token-vectors of {MAX_TOKEN_VECTORS}"),
    ({"texts": [" ".join(["bees"] * 50)] * 4, "outputs": [pb.OUTPUT_DENSE, pb.OUTPUT_TOKENS]},
     "outputs OUTPUT_TOKENS: the request's texts hold 208 tokens"),
], ids=["top-k-0", "unknown", "sparse-tokens-dense", "sparse-tokens-tokens", "top-k-dense", "int8", "dimensions",
        "max-token-vectors-sparse", "max-token-vectors-tokens"])
def test_bad_requests_are_refused_naming_the_field(stub, fields, words):
    request = pb.EmbedRequest(texts=TEXTS[:1])
    request.MergeFrom(pb.EmbedRequest(**fields))
    if "texts" in fields:
        del request.texts[0]
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details(), err.value.details()
    long = [" ".join(["bees"] * 50)] * 4  # the same texts as dense vectors alone: no token bound
    assert vectors(stub.Embed(pb.EmbedRequest(texts=long), timeout=30)).shape == (4, HIDDEN)


def test_http_sparse_tokens_without_sparse_is_refused(server):
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/embeddings",
                                     json.dumps({"input": "bees", "sparse_tokens": True}).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["param"] == "sparse_tokens", error


def test_the_token_bound_a_text_is_the_wide_rows(m3_path):
    """A text's token rows must fit one answer record at BGE-M3's row width, 2 x hidden + 1."""
    from pollen.server.config import ServeConfig
    from pollen.server.model_table import token_limits
    from pollen.shared_mem import records
    from pollen.shared_mem.ring import Ring

    cfg = ServeConfig.from_args(["--model", m3_path, "--response-ring-bytes", str(1 << 20)], environ={})
    limits = token_limits(cfg, read_model_spec(m3_path))
    assert limits.per_text == records.max_batch_rows(Ring.max_record_for(1 << 20), 2 * HIDDEN + 1)
    assert limits.per_text < records.max_batch_rows(Ring.max_record_for(1 << 20), HIDDEN)


def test_the_automatic_ring_holds_a_text_of_the_model_s_longest_as_token_rows(m3_path):
    """By default a text of BGE-M3's full length (8,192 tokens at the real width) gets its sparse
    and ColBERT vectors, a row a token of 2 x hidden + 1 values; a plain model's ring stays 16 MiB."""
    from pollen.server.config import ServeConfig
    from pollen.server.model_table import token_limits
    from pollen.server.process.app import check_limits

    spec = dataclasses.replace(read_model_spec(m3_path), hidden_size=1024, max_tokens=8192)
    cfg = ServeConfig()
    check_limits(cfg, [spec])
    assert token_limits(cfg, spec).per_text >= 8192
    assert cfg.response_ring_bytes <= 2 * 8193 * 4 * spec.output_dims + (2 << 20)  # that, and no more
    plain = ServeConfig()
    check_limits(plain, [dataclasses.replace(spec, bge_m3=False)])
    assert plain.response_ring_bytes == 16 << 20


def serve(model) -> subprocess.CompletedProcess:
    return subprocess.run([POLLEN, "serve", "--model", str(model), "--listen", f"127.0.0.1:{free_port()}",
                           "--http-listen", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)


class _Unsafe:
    """A pickled object torch's weights_only loader refuses to build."""

    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.parametrize("breaks, says", [
    (lambda p: torch.save({"weight": _Unsafe()}, p / "sparse_linear.pt"),
     "sparse_linear.pt: not a state dict torch reads with weights_only"),
    (lambda p: (p / "colbert_linear.pt").write_bytes(b"not a torch file"),
     "colbert_linear.pt: not a state dict torch reads with weights_only"),
    (lambda p: torch.save(torch.nn.Linear(HIDDEN, 2).state_dict(), p / "sparse_linear.pt"),
     f"sparse_linear.pt: tensor weight has shape (2, {HIDDEN})"),
    (lambda p: (p / "colbert_linear.pt").unlink(), "needs both sparse_linear.pt and colbert_linear.pt"),
], ids=["unsafe-pickle", "not-torch", "wrong-shape", "missing"])
def test_a_folder_with_bad_heads_is_refused_at_start_in_one_line(m3_path, tmp_path, breaks, says):
    model = tmp_path / "m3"
    shutil.copytree(m3_path, model)
    breaks(model)
    done = serve(model)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert str(model) in last and says in last, last
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-eager", "bf16-graphs"])
def test_the_engine_rows_on_cuda_equal_the_cpu(m3_path, dtype):
    """The head on the CUDA engine (bfloat16: inside its captured graphs), on pooled rows and on the
    token row plan: h, the ColBERT projection and the sparse weight of each row as the CPU's."""
    from pollen.worker.engine import make_engine
    from pollen.worker.models.loader import load_model
    from pollen.worker.packed import RowSpans, pack
    from tests.st_models import token_ids

    seqs = token_ids(m3_path, TEXTS)
    engine = make_engine(load_model(m3_path, device="cuda", dtype=dtype), "cuda", max_batch_tokens=1024)
    engine.warm_up()
    for spans in (None, RowSpans.of([[(i, i + 1) for i in range(len(s))] for s in seqs])):
        cpu = make_engine(load_model(m3_path), "cpu").submit(pack(seqs, spans)).result()
        gpu = np.asarray(engine.submit(pack(seqs, spans)).result())
        assert gpu.shape == cpu.shape == (len(cpu), 2 * HIDDEN + 1)
        for part in (slice(0, HIDDEN), slice(HIDDEN, 2 * HIDDEN)):
            assert cosine_rows(gpu[:, part], cpu[:, part]).min() >= (0.99999 if dtype == torch.float32 else 0.99)
        assert (gpu[:, -1] >= 0).all() and np.abs(gpu[:, -1] - cpu[:, -1]).max() <= 0.05 * max(1, cpu[:, -1].max())
    if dtype == torch.bfloat16:
        assert engine.graphs  # the batches' buckets were captured and replayed
    engine.close()


def test_the_benchmark_folder_builder_makes_a_folder_served_as_bge_m3(tmp_path):
    """load/m3_models.py's folder (here its tiny sizes, the MiniLM tokenizer) is the real layout:
    read as BGE-M3, and its heads load."""
    from load.m3_models import TINY, make_bge_m3
    from pollen.common.model_spec import default_model_path
    from pollen.worker.models.loader import load_model

    path = make_bge_m3(str(tmp_path), default_model_path(), tiny=True)
    spec = read_model_spec(path)
    assert (spec.bge_m3, spec.hidden_size, spec.max_tokens, spec.vocab_size) == (True, TINY["hidden_size"], 8192,
                                                                                 250002)
    assert spec.sparse_skip_ids  # [CLS], [PAD], [UNK] by the tokenizer's own names
    hidden = TINY["hidden_size"]
    assert load_model(path).output_head(torch.zeros(1, hidden)).shape == (1, 2 * hidden + 1)


def test_the_bulk_embedder_answers_the_dense_vectors(m3_path, want):
    """pollen bulk's embedder cuts the dense vector out of BGE-M3's wider rows, whole or a prefix."""
    from pollen.bulk.embedder import BulkEmbedder

    dense = np.stack([w["dense"] for w in want])
    for dims in (0, 32):
        got = BulkEmbedder(m3_path, dimensions=dims).embed(TEXTS)
        assert got.shape == (len(TEXTS), dims or HIDDEN)
        assert cosine_rows(got, dense[:, :dims or HIDDEN]).min() >= 0.99999
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
