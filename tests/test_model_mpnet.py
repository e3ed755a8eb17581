"""Our packed MPNet against sentence-transformers' encode (fp32, CPU) on tiny random MPNet
checkpoints laid out as all-mpnet-base-v2 is (MPNet, mean pooling, Normalize), with its vocabulary
and tokenizer; and its relative-position bias against HF's. sentence-transformers and HF are the
references here, never the engine.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import shutil

import numpy as np
import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, default_model_path, read_model_spec
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.v1 import embedder_pb2 as pb
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.models.loader import load_model
from pollen.worker.models.relative_position import MAX_DISTANCE, bias_table, relative_buckets
from pollen.worker.packed import pack
from pollen.worker.postprocess import finish

SIZES = [16, 32, 64]
PROMPTS = {"query": "query: "}
# Mixed lengths: a word, sentences, and texts past MAX_DISTANCE tokens (every bucket in use) and
# past max_seq_length 384 (truncated).
TEXTS = [
    "hello", "A man is eating food.", "What is the capital of France?", "naïve café résumé 東京 🙂",
    "Paris is the capital and most populous city of France. " * 4,
    "The history of natural language processing generally started in the 1950s. " * 12,
    " ".join(f"word{i} and more" for i in range(60)),
    "Long document. " + "Embeddings map text to vectors so that similar meanings end up close together. " * 40,
    "x",
]


def make_tiny_mpnet(path, normalize=True, masked_lm=False, st_config=None, max_seq_length=384, seed=0,
                    hidden=64, heads=4, pooling="mean_tokens"):
    """A tiny random MPNet with all-mpnet-base-v2's vocabulary layout (<s> <pad> </s> <unk>, then
    BERT's WordPiece vocabulary, then <mask>) and tokenizer, plus its sentence-transformers files."""
    import transformers as tf

    torch.manual_seed(seed)
    # MiniLM's WordPiece vocabulary: the bundled model's, or (on a GPU host without that package)
    # the copy POLLEN_BERT_TOKENIZER_DIR names.
    vocab_dir = os.environ.get("POLLEN_BERT_TOKENIZER_DIR") or default_model_path()
    with open(os.path.join(vocab_dir, "vocab.txt"), encoding="utf-8") as f:
        words = [w for w in f.read().splitlines() if w]
    vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"])}
    config = tf.MPNetConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=2,
                            num_attention_heads=heads, intermediate_size=3 * hidden // 2, max_position_embeddings=514)
    model = (tf.MPNetForMaskedLM if masked_lm else tf.MPNetModel)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                # HF's init (std 0.02) would leave a wrong bucket or sign invisible in the output.
                p.normal_(0.0, 1.5)
            elif "LayerNorm.weight" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tf.MPNetTokenizer(vocab=vocab, unk_token="[UNK]").save_pretrained(str(path))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden,
                                                                f"pooling_mode_{pooling}": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}))
    if st_config:
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return model


def st_encode(path, texts, without_normalize=False, **kwargs):
    """sentence-transformers' encode of the folder; without_normalize: of its modules before Normalize."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    if without_normalize:
        assert type(model[2]).__name__ == "Normalize"
        model = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    return model.encode(texts, batch_size=4, convert_to_numpy=True, **kwargs)


def pollen_rows(path, texts, prompt="", dims=0, normalize=True):
    """The served path without the server: the frontend's tokenizer, one packed batch through the
    CPU engine, then the worker's cut and normalization (worker/postprocess.py)."""
    model = load_model(str(path))
    seqs = TextTokenizer(str(path), model.spec.max_tokens).encode(texts, pb.TRUNCATE_END, prompt=prompt)
    pooled = EagerEngine(model).submit(pack(seqs)).result()
    out = np.empty((len(texts), dims or pooled.shape[1]), np.float32)
    finish(pooled, dims, normalize, pb.ENCODING_FLOAT32, memoryview(out).cast("B"))
    return out, [len(s) for s in seqs]


def assert_rows_match(ours, ref, lengths=False):
    assert ours.shape == ref.shape
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    worst = int(cos.argmin())
    assert cos.min() >= 0.99999, f"text {worst} {TEXTS[worst][:40]!r}: cosine {cos[worst]}"
    if lengths:
        np.testing.assert_allclose(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1), rtol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """all-mpnet-base-v2's layout: mean pooling, Normalize; with prompts and Matryoshka sizes declared."""
    path = tmp_path_factory.mktemp("mpnet") / "m"
    make_tiny_mpnet(path, st_config={"prompts": PROMPTS, "matryoshka_dimensions": SIZES})
    return path


# ---------------------------------------------------------------- the bias against HF's


def test_buckets_and_table_equal_hf():
    """Our bucket of every relative position (clamped at MAX_DISTANCE) is HF's, and the table
    gives HF's bias [heads, L, L] for a sequence long enough to use every bucket."""
    import transformers as tf
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    relative = torch.arange(-1000, 1001)
    hf = MPNetEncoder.relative_position_bucket(relative)
    assert torch.equal(relative_buckets(relative.clamp(-MAX_DISTANCE, MAX_DISTANCE)), hf)
    assert hf.unique().numel() == 31  # every bucket but "after the query at distance 0"

    torch.manual_seed(0)
    encoder = MPNetEncoder(tf.MPNetConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1))
    n = 300
    with torch.no_grad():
        encoder.relative_attention_bias.weight.normal_()
        want = encoder.compute_position_bias(torch.zeros(1, n, 32))[0]  # [heads, n, n]
    table = bias_table(encoder.relative_attention_bias.weight.detach())
    at = torch.arange(n)
    got = table[:, (at[None, :] - at[:, None]).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE]
    assert torch.equal(got, want)


# ---------------------------------------------------------------- the engine against sentence-transformers


@pytest.mark.parametrize("masked_lm", [False, True])
def test_engine_matches_sentence_transformers(tmp_path, masked_lm):
    """MPNetModel's names, and MPNetForMaskedLM's ("mpnet." prefix, as all-mpnet-base-v2 is saved)."""
    make_tiny_mpnet(tmp_path / "m", masked_lm=masked_lm)
    spec = read_model_spec(str(tmp_path / "m"))
    assert (spec.family, spec.pooling, spec.max_tokens, spec.causal) == ("mpnet", "mean", 384, False)
    ours, lengths = pollen_rows(tmp_path / "m", TEXTS)
    assert max(lengths) == 384 and sorted(lengths)[-3] > MAX_DISTANCE, lengths  # truncated; far buckets in use
    assert min(lengths) == 3  # <s> x </s>
    assert_rows_match(ours, st_encode(tmp_path / "m", TEXTS))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_lengths_without_normalize(tmp_path, pooling):
    """A folder with no Normalize module (multi-qa-mpnet-base-dot-v1: CLS pooling, dot product):
    the rows' lengths are sentence-transformers' too."""
    make_tiny_mpnet(tmp_path / "m", normalize=False, seed=3, pooling={"mean": "mean_tokens", "cls": "cls_token"}[pooling])
    assert read_model_spec(str(tmp_path / "m")).pooling == pooling
    ours, _ = pollen_rows(tmp_path / "m", TEXTS, normalize=False)
    ref = st_encode(tmp_path / "m", TEXTS)
    assert np.abs(np.linalg.norm(ref, axis=1) - 1).max() > 0.1  # really not unit vectors
    assert_rows_match(ours, ref, lengths=True)


@pytest.mark.parametrize("dims", [16, 32])
def test_matryoshka_and_prompt(tiny, dims):
    spec = read_model_spec(str(tiny))
    assert list(spec.matryoshka_dimensions) == SIZES and dict(spec.prompts) == PROMPTS
    ours, _ = pollen_rows(tiny, TEXTS, dims=dims)
    assert_rows_match(ours, st_encode(tiny, TEXTS, truncate_dim=dims, normalize_embeddings=True), lengths=True)
    prompted, _ = pollen_rows(tiny, TEXTS, prompt=PROMPTS["query"], dims=dims)
    ref = st_encode(tiny, TEXTS, prompt_name="query", truncate_dim=dims, normalize_embeddings=True)
    assert_rows_match(prompted, ref, lengths=True)
    assert np.abs(prompted - ours).max() > 1e-2  # the prompt really changed the input


def test_the_cpu_takes_the_sdpa_loop(tiny):
    model = load_model(str(tiny))
    assert model.attention.kernel is None and model.host_syncs
    assert all(layer.attention is model.attention for layer in model.layers)  # one table for all layers
    assert model.attention.table.shape == (4, 2 * MAX_DISTANCE + 1)


# ---------------------------------------------------------------- what the spec refuses


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("change,message", [
    ({"relative_attention_num_buckets": 16}, "relative_attention_num_buckets must be an integer of at least 32"),
    ({"hidden_act": "relu"}, "hidden_act 'relu'"),
    ({"num_attention_heads": 5}, "not a multiple of num_attention_heads"),
])
def test_unsupported_configs_are_named(tiny_copy, change, message):
    edit_config(tiny_copy, **change)
    with pytest.raises(UnsupportedModel, match=message):
        read_model_spec(str(tiny_copy))


def test_causal_attention_is_refused_and_positions_bound(tiny_copy):
    with pytest.raises(UnsupportedModel, match="mpnet encoders are bidirectional"):
        read_model_spec(str(tiny_copy), attention="causal")
    (tiny_copy / "sentence_bert_config.json").unlink()
    assert read_model_spec(str(tiny_copy)).max_tokens == 512  # 514 rows less the two RoBERTa-style ones
    model = load_model(str(tiny_copy))
    with pytest.raises(ValueError, match="513 tokens exceeds 512 positions"):
        model(torch.full((513,), 7), torch.tensor([0, 513], dtype=torch.int32), 513)


def test_missing_bias_tensor_is_named(tiny_copy):
    from safetensors.torch import load_file, save_file

    file = tiny_copy / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["encoder.relative_attention_bias.weight"]
    save_file(tensors, str(file))
    with pytest.raises(UnsupportedModel, match=r"encoder\.relative_attention_bias\.weight"):
        load_model(str(tiny_copy))


# ---------------------------------------------------------------- through the real server


def test_http_matches_sentence_transformers(tiny):
    """`pollen serve` on the tiny checkpoint: /v1/embeddings equals sentence-transformers, with and
    without a Matryoshka size and a prompt, and the unnormalized rows keep their lengths."""
    import http.client

    from tests.conftest import ServerProcess

    srv = ServerProcess("--model", str(tiny)).start()
    try:
        def post(**body):
            conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
            conn.request("POST", "/v1/embeddings", body=json.dumps({"input": TEXTS, "truncate": "end", **body}),
                         headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            payload = json.loads(reply.read())
            conn.close()
            assert reply.status == 200, payload
            return np.array([d["embedding"] for d in payload["data"]], dtype=np.float32)

        assert_rows_match(post(), st_encode(tiny, TEXTS))
        assert_rows_match(post(dimensions=32), st_encode(tiny, TEXTS, truncate_dim=32, normalize_embeddings=True),
                          lengths=True)
        assert_rows_match(post(prompt_name="query"), st_encode(tiny, TEXTS, prompt_name="query"))
        # normalize: false gives the mean pool as it is: sentence-transformers' rows before Normalize.
        raw, ref = post(normalize=False), st_encode(tiny, TEXTS, without_normalize=True)
        assert np.abs(np.linalg.norm(ref, axis=1) - 1).max() > 0.1
        assert_rows_match(raw, ref, lengths=True)
    finally:
        assert srv.terminate() == 0
