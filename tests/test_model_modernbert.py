"""Our packed ModernBERT against sentence-transformers' encode (fp32, CPU) on tiny random checkpoints.

Each checkpoint is a ModernBertModel saved by transformers, with a byte-level BPE tokenizer built
like ModernBERT's ([CLS] text [SEP], NFC, GPT-2's regex) and the sentence-transformers folder
files (Pooling, and Normalize where asked). The windows are small (local_attention 8 or 16) and
most texts are longer, so the sliding-window layers see only part of each text; a test shows the
comparison fails when the window is dropped. Texts go through pollen's own tokenizer path
(server/pipeline/tokenizer.py); sentence-transformers is the reference, never pollen.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import random

import numpy as np
import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.v1 import embedder_pb2 as pb
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.loader import load_model
from pollen.worker.packed import pack
from tests.test_model_bert import write_st_files

MAX_TOKENS = 256
_WORDS = ("search", "embedding", "server", "query", "the", "of", "and", "GPU", "token", "vector", "it's",
          "window", "1999", "3.5", "x86_64", "e-mail", "C++", "(note)", "don't", "rotary", "global", "local")


def texts(count=12, seed=5, lengths=(1, 2, 3, 6, 9, 14, 20, 33, 48, 70, 95, 130)):
    """Mixed lengths (in words): one-word texts, and by default texts of up to about 150 tokens
    (far past every window)."""
    rng = random.Random(seed)
    lengths = list(lengths)
    return [" ".join(rng.choice(_WORDS) for _ in range(n)) for n in (lengths * (1 + count // len(lengths)))[:count]]


def corpus(seed=3, lines=2000):
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) for _ in range(lines)]


def write_tokenizer(path, max_tokens=MAX_TOKENS):
    """ModernBERT's tokenizer pipeline (NFC, byte-level BPE with GPT-2's regex, [CLS] $A [SEP], a
    left-stripping [MASK], GPT-NeoX's added runs of spaces and unused tokens) trained on a small
    corpus; returns its vocabulary size and the [PAD] id."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    specials = ["<|endoftext|>", "<|padding|>", "[UNK]", "[CLS]", "[SEP]", "[PAD]",
                AddedToken("[MASK]", lstrip=True, special=True), *(f"[unused{i}]" for i in range(8))]
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([AddedToken(" " * n, normalized=True) for n in range(2, 25)])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": max_tokens,
        "model_input_names": ["input_ids", "attention_mask"]}))
    return tok.get_vocab_size(), tok.token_to_id("[PAD]")


def make_tiny_modernbert(path, pooling="mean", normalize=False, local_attention=8, every=3, biases=False,
                         legacy=False, seed=0, max_tokens=MAX_TOKENS, shape=None, gain=1.5, **st_config):
    """Save a tiny random ModernBERT folder: weights, tokenizer, sentence-transformers files.

    Weights are drawn wider than ModernBERT's init (std 0.02 would leave attention near uniform,
    where a window changes little), norm weights and biases randomized. legacy: config.json in
    the original spelling (global_attn_every_n_layers, global/local_rope_theta) instead of
    transformers 5's layer_types and rope_parameters. shape: other sizes than the tiny ones.
    """
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    vocab, pad = write_tokenizer(path, max_tokens)
    torch.manual_seed(seed)
    sizes = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96) | (shape or {})
    config = tf.ModernBertConfig(
        vocab_size=vocab, **sizes, max_position_embeddings=max_tokens, local_attention=local_attention,
        global_attn_every_n_layers=every,
        global_rope_theta=80000.0, local_rope_theta=5000.0, norm_bias=biases, attention_bias=biases, mlp_bias=biases,
        pad_token_id=pad, bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None)
    model = tf.ModernBertModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1 + 0.3 * torch.randn_like(p)) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (1.0 if "embeddings" in name else gain))
    model.save_pretrained(str(path))
    if legacy:
        cfg = json.loads((path / "config.json").read_text())
        del cfg["layer_types"], cfg["rope_parameters"]
        cfg |= {"global_attn_every_n_layers": every, "global_rope_theta": 80000.0, "local_rope_theta": 5000.0}
        (path / "config.json").write_text(json.dumps(cfg))
    write_st_files(path, pooling, normalize)
    pooling_file = path / "1_Pooling" / "config.json"  # sentence-transformers wants the width too
    width = {"word_embedding_dimension": sizes["hidden_size"]}
    pooling_file.write_text(json.dumps({**json.loads(pooling_file.read_text()), **width}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_tokens}))
    if st_config:
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return str(path)


def reference(path, inputs, **options):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(inputs, batch_size=5, convert_to_numpy=True, **options)


def pollen_ids(path, inputs, prompt=""):
    return TextTokenizer(path, read_model_spec(path).max_tokens).encode(inputs, pb.TRUNCATE_END, prompt=prompt)


def engine_rows(model, seqs):
    return EagerEngine(model).submit(pack(seqs)).result()


def assert_rows_match(ours, ref, cos_min=0.99999):
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= cos_min, f"row {cos.argmin()}: cosine {cos.min()}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)


@pytest.mark.parametrize("pooling,local_attention,every,biases,legacy", [
    ("mean", 8, 3, False, False), ("cls", 16, 2, True, False), ("mean", 8, 2, False, True), ("cls", 8, 3, True, True),
    ("mean", 128, 3, False, False)])  # ModernBERT's own window: the longest texts pass it
def test_tiny_modernbert_matches_sentence_transformers(tmp_path, pooling, local_attention, every, biases, legacy):
    path = make_tiny_modernbert(tmp_path / "m", pooling, local_attention=local_attention, every=every,
                                biases=biases, legacy=legacy)
    spec = read_model_spec(path)
    assert (spec.family, spec.pooling, spec.causal, spec.max_tokens) == ("modernbert", pooling, False, MAX_TOKENS)
    model = load_model(path)
    assert [layer.is_global for layer in model.layers] == [i % every == 0 for i in range(4)]
    assert model.attention[False].window == local_attention // 2 and model.attention[True].window is None
    inputs = texts()
    seqs = pollen_ids(path, inputs)
    assert max(len(s) for s in seqs) > local_attention + 1  # past the window
    ref = reference(path, inputs)
    assert_rows_match(engine_rows(model, seqs), ref)
    # One packed batch in another order and cut into two: the same rows.
    order = list(range(len(seqs)))[::-1]
    halves = [engine_rows(model, [seqs[i] for i in order[:5]]), engine_rows(model, [seqs[i] for i in order[5:]])]
    assert_rows_match(np.concatenate(halves), ref[order])


def test_the_window_matters(tmp_path):
    """Without the window (every layer global) or with a window one token wider, the rows no longer
    match: the comparison above checks the window's exact reach."""
    path = make_tiny_modernbert(tmp_path / "m", "mean", local_attention=8)
    inputs = texts()
    seqs, ref = pollen_ids(path, inputs), reference(path, inputs)
    model = load_model(path)
    assert_rows_match(engine_rows(model, seqs), ref)
    for wrong in (None, 5):
        model.attention[False] = VarlenAttention("sdpa_loop", window=wrong)
        ours = engine_rows(model, seqs)
        cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
        long = [i for i, s in enumerate(seqs) if len(s) > 10]
        assert cos[long].max() < 0.9999, wrong  # every text past the window moved
        assert cos[[i for i, s in enumerate(seqs) if len(s) <= 5]].min() >= 0.99999  # none within it


def test_matryoshka_and_prompts(tmp_path):
    """A prompt is tokenized with the text (pollen's tokenizer path, as sentence-transformers does);
    a Matryoshka prefix is the first d values of the full row."""
    prompts = {"query": "search_query: ", "document": "search_document: "}
    path = make_tiny_modernbert(tmp_path / "m", "mean", normalize=True, prompts=prompts,
                                matryoshka_dimensions=[64, 32])
    spec = read_model_spec(path)
    assert dict(spec.prompts) == prompts and spec.matryoshka_dimensions == (32, 64)
    inputs = texts(6, seed=9)
    model = load_model(path)
    rows = engine_rows(model, pollen_ids(path, inputs, prompt=prompts["query"]))
    full = reference(path, inputs, prompt_name="query")
    assert_rows_match(rows / np.linalg.norm(rows, axis=1, keepdims=True), full)
    cut = reference(path, inputs, prompt_name="query", truncate_dim=32)
    prefix = rows[:, :32] / np.linalg.norm(rows[:, :32], axis=1, keepdims=True)
    assert_rows_match(prefix, cut / np.linalg.norm(cut, axis=1, keepdims=True))


def test_masked_lm_checkpoint_loads_under_its_prefix(tmp_path):
    """ModernBertForMaskedLM (how ModernBERT-base itself is saved) keeps the encoder under "model."."""
    import transformers as tf
    from safetensors import safe_open

    path = make_tiny_modernbert(tmp_path / "m", "cls")
    base = tf.ModernBertModel.from_pretrained(path)
    mlm = tf.ModernBertForMaskedLM(base.config)
    mlm.model.load_state_dict(base.state_dict())
    mlm.save_pretrained(path)
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.attn.Wqkv.weight" in f.keys() and "layers.0.attn.Wqkv.weight" not in f.keys()
    inputs = texts(6)
    assert_rows_match(engine_rows(load_model(path), pollen_ids(path, inputs)), reference(path, inputs))


def test_the_tokenizer_path_gives_sentence_transformers_ids(tmp_path):
    """pollen's tokenizer (one query, batches, truncation at the limit) feeds the model the ids
    sentence-transformers' tokenizer gives; a lone ASCII query takes the tiktoken path."""
    from sentence_transformers import SentenceTransformer

    path = make_tiny_modernbert(tmp_path / "m")
    tokenizer = TextTokenizer(path, MAX_TOKENS)
    assert tokenizer.ascii_bpe is not None
    st = SentenceTransformer(path, device="cpu")
    inputs = texts() + ["  spaced\tout\n", "two  spaces   and three", "東京 🙂 e-mail", "a [MASK] token",
                        "end of text<|endoftext|>", " ".join(["window"] * 400)]
    want = st.tokenize(inputs)
    mask = want["attention_mask"].bool()
    want_ids = [row[m].tolist() for row, m in zip(want["input_ids"], mask)]
    assert [ids.tolist() for ids in tokenizer.encode(inputs, pb.TRUNCATE_END)] == want_ids
    assert [tokenizer.encode([t], pb.TRUNCATE_END)[0].tolist() for t in inputs] == want_ids
    assert len(want_ids[-1]) == MAX_TOKENS


@pytest.mark.parametrize("change,message", [
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4}}}, "RoPE type 'yarn'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
    ({"layer_types": None, "rope_parameters": None, "local_rope_theta": None}, "RoPE base"),
    ({"num_attention_heads": 5}, "multiple of num_attention_heads"),
    ({"global_attn_every_n_layers": 0, "layer_types": None}, "global_attn_every_n_layers"),
    ({"architectures": ["ModernBertForSequenceClassification"]}, "ModernBertForSequenceClassification"),
])
def test_unsupported_modernbert_configs_are_named(tmp_path, change, message):
    path = make_tiny_modernbert(tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = {**json.loads(cfg_file.read_text()), **change}
    cfg_file.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None or k == "local_rope_theta"}))
    with pytest.raises(UnsupportedModel, match=message):
        read_model_spec(path)


def test_causal_attention_is_refused_and_a_missing_weight_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_modernbert(tmp_path / "m")
    with pytest.raises(UnsupportedModel, match="bidirectional"):
        read_model_spec(path, attention="causal")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["layers.2.mlp.Wi.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match=r"layers\.2\.mlp\.Wi\.weight"):
        load_model(path)


def test_bf16_close_to_fp32_reference(tmp_path):
    # gain 1: attention no sharper than trained models', which bf16's rounding would otherwise dominate
    path = make_tiny_modernbert(tmp_path / "m", "cls", local_attention=16, every=2, biases=True, gain=1.0)
    inputs = texts()
    ours = engine_rows(load_model(path, dtype=torch.bfloat16), pollen_ids(path, inputs))
    ref = reference(path, inputs)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999


def test_pollen_serve_over_http_equals_sentence_transformers(tmp_path):
    """The real server: plain rows with normalize false (the folder has no Normalize: lengths
    too), a Matryoshka prefix, and a named prompt, each against sentence-transformers."""
    import http.client

    from tests.conftest import ServerProcess

    prompts = {"query": "search_query: "}
    path = make_tiny_modernbert(tmp_path / "m", "cls", local_attention=16, every=2, biases=True, prompts=prompts)
    inputs = texts()

    def embed(**options) -> np.ndarray:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        body = {"input": inputs, "encoding_format": "float", **options}
        conn.request("POST", "/v1/embeddings", body=json.dumps(body), headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        payload = json.loads(reply.read())
        conn.close()
        assert reply.status == 200, payload
        return np.array([row["embedding"] for row in payload["data"]], dtype=np.float32)

    server = ServerProcess("--model", path).start()
    try:
        plain, cut, prompted = embed(normalize=False), embed(dimensions=32), embed(prompt_name="query")
    finally:
        assert server.terminate() == 0
    assert_rows_match(plain, reference(path, inputs))
    cut_ref = reference(path, inputs, truncate_dim=32)
    assert_rows_match(cut, cut_ref / np.linalg.norm(cut_ref, axis=1, keepdims=True))
    assert_rows_match(prompted, reference(path, inputs, prompt_name="query", normalize_embeddings=True))
