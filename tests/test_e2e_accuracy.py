"""Through the running server: embeddings equal sentence-transformers', and STS-B agrees."""
from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import cosine_rows, vectors
from tests.texts import stsb_pairs, varied_texts


def embed_all(stub, texts: list[str], chunk: int = 32, **options) -> np.ndarray:
    out = []
    for i in range(0, len(texts), chunk):
        request = pb.EmbedRequest(texts=texts[i:i + chunk], normalize=True, truncate=pb.TRUNCATE_END, **options)
        out.append(vectors(stub.Embed(request, timeout=120)))
    return np.concatenate(out)


def test_varied_texts_match_sentence_transformers(stub, reference):
    texts = varied_texts(200)
    ours = embed_all(stub, texts)
    ref = reference(texts)
    cos = cosine_rows(ours, ref)
    worst = int(np.argmin(cos))
    assert cos.min() >= 0.9999, f"text {worst} ({texts[worst][:60]!r}): cosine {cos[worst]:.6f}"
    # normalize=True really normalized.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_the_set_holds_one_token_and_over_512_token_texts(stub):
    """The accuracy test above must cover the extremes the issue names."""
    from tokenizers import Tokenizer

    from pollen.common.model_spec import default_model_path

    tok = Tokenizer.from_file(f"{default_model_path()}/tokenizer.json")
    tok.no_truncation()
    tok.no_padding()
    lengths = [len(e.ids) for e in tok.encode_batch(varied_texts(200))]
    assert sum(n > 512 for n in lengths) >= 3
    assert min(lengths) == 3  # [CLS] one-token [SEP]
    # And the server cut them to all-MiniLM-L6-v2's max_seq_length.
    texts = varied_texts(200)
    counts = [n for i in range(0, 200, 50)
              for n in stub.Tokenize(pb.TokenizeRequest(texts=texts[i:i + 50], truncate=pb.TRUNCATE_END)).counts]
    assert max(counts) == 256 and counts == [min(n, 256) for n in lengths]


def test_stsb_spearman_matches_sentence_transformers(stub, reference):
    pairs = stsb_pairs()
    assert len(pairs) == 1379
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    gold = np.array([p[2] for p in pairs])
    ours_a, ours_b = embed_all(stub, a, chunk=64), embed_all(stub, b, chunk=64)
    ref_a, ref_b = reference(a), reference(b)
    ours = spearmanr((ours_a * ours_b).sum(1), gold).statistic * 100
    ref = spearmanr((ref_a * ref_b).sum(1), gold).statistic * 100
    print(f"STS-B Spearman x100: pollen {ours:.3f}, sentence-transformers {ref:.3f}")
    assert abs(ours - ref) <= 0.05
    assert abs(ref - 82.03) <= 0.05  # the published figure for all-MiniLM-L6-v2
