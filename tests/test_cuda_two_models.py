"""An embedder and a reranker in one `pollen serve --device cuda` (one worker holding both, each
on its own engine and streams): under a rerank load running at the same time, every embedding
answer equals sentence-transformers' fp32 vectors (cosine >= 0.999, bf16) and every rerank answer
is within 0.02 of CrossEncoder's fp32 score. Both are small random BERTs (an embedder with mean
pooling, a cross-encoder) with MiniLM's tokenizer files from POLLEN_BERT_TOKENIZER_DIR. Skipped
cleanly without a GPU or that directory."""

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)"),
              pytest.mark.skipif(not os.environ.get("POLLEN_BERT_TOKENIZER_DIR"),
                                 reason="needs POLLEN_BERT_TOKENIZER_DIR (MiniLM's tokenizer files)")]

import json  # noqa: E402

from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.st_models import copy_bert_tokenizer  # noqa: E402
from tests.test_rerank_api import DOCS, QUERY  # noqa: E402

TEXTS = [f"query number {i} about bees, honey and the hive" for i in range(64)]


def small_bert(path, head: bool) -> str:
    """A random BERT (6 layers of 384, MiniLM's shape) as an embedder or a one-label cross-encoder."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(3 if head else 4)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=1)
    (BertForSequenceClassification if head else BertModel)(config).eval().save_pretrained(str(path))
    copy_bert_tokenizer(path)
    if not head:
        os.makedirs(os.path.join(path, "1_Pooling"))
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True}, f)
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
                      f)
    return str(path)


def test_both_models_answer_right_while_both_run(tmp_path):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    embedder, reranker = small_bert(tmp_path / "embedder", False), small_bert(tmp_path / "reranker", True)
    vectors = SentenceTransformer(embedder, device="cpu").encode(TEXTS, normalize_embeddings=True)
    reference = CrossEncoder(reranker, device="cpu").predict([(QUERY, d) for d in DOCS])
    srv = ServerProcess("--model", embedder, "--model", reranker, "--device", "cuda",
                        "--warmup-seconds", "5").start(timeout=600)

    async def run():
        async with grpc.aio.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            embeds = [stub.Embed(pb.EmbedRequest(texts=[t], normalize=True), timeout=60) for t in TEXTS]
            reranks = [stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCS * 20,
                                                    priority=pb.PRIORITY_BULK if i % 2 else pb.PRIORITY_INTERACTIVE),
                                   timeout=60) for i in range(16)]
            return await asyncio.gather(*embeds), await asyncio.gather(*reranks)

    try:
        embedded, ranked = asyncio.run(run())
    finally:
        assert srv.terminate() == 0
    got = np.stack([np.frombuffer(r.embeddings, np.float32) for r in embedded])
    assert (np.sum(got * vectors, axis=1) >= 0.999).all()
    for reply in ranked:
        scores = np.array([r.score for r in sorted(reply.results, key=lambda r: r.index)]).reshape(20, len(DOCS))
        assert np.abs(scores - reference).max() <= 0.02  # bf16 against fp32
