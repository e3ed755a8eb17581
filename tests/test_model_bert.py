"""Our packed BERT against the references: HF transformers (tiny random models) and
sentence-transformers (the real all-MiniLM-L6-v2). HF code is the reference here, never the engine."""

import os

# Before anything imports huggingface_hub: it reads these once, at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import shutil
import subprocess
import sys

import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, default_model_path, read_model_spec
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.loader import load_model
from pollen.worker.models.packing import positions
from pollen.worker.models.pooling import pool

LENGTHS = [1, 7, 2, 33, 64, 12, 5]  # one packed batch; 64 is the tiny model's position limit


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# ---------------------------------------------------------------- helpers


def write_st_files(path, pooling="mean", normalize=True, extra_modules=()):
    """The sentence-transformers files a served model directory carries."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    modules += list(extra_modules)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "lasttoken": "lasttoken"}
    cfg = {f"pooling_mode_{m}": m == modes[pooling] for m in modes.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def make_tiny(path, kind="bert", pooling="mean", act="gelu", max_shard_size=None):
    """Save a tiny random HF model to `path`; return the HF encoder to compare against."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  vocab_size=1000, hidden_act=act)
    if kind == "xlm-roberta":
        # 64 usable positions: RoBERTa-style models reserve pad_token_id + 1 = 2 rows.
        model = tf.XLMRobertaModel(tf.XLMRobertaConfig(**common, max_position_embeddings=66, pad_token_id=1))
    elif kind == "bert-mlm":  # checkpoint names carry a "bert." prefix plus an MLM head
        model = tf.BertForMaskedLM(tf.BertConfig(**common, max_position_embeddings=64))
    else:
        model = tf.BertModel(tf.BertConfig(**common, max_position_embeddings=64))
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    write_st_files(path, pooling)
    return model.bert if kind == "bert-mlm" else model


def random_batch(lengths, vocab=1000, seed=1):
    g = torch.Generator().manual_seed(seed)
    # ids >= 5: never a pad id, which HF's RoBERTa would (rightly) skip when numbering positions.
    seqs = [torch.randint(5, vocab, (n,), generator=g) for n in lengths]
    return seqs, *pack(seqs)


def pack(seqs):
    ids = torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([len(s) for s in seqs]).cumsum(0)
    return ids, cu, max(len(s) for s in seqs)


@torch.no_grad()
def hf_pooled(hf_model, seqs, pooling):
    """Reference: each sequence alone through HF, pooled by hand."""
    out = []
    for s in seqs:
        h = hf_model(input_ids=s[None]).last_hidden_state[0]
        out.append({"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling])
    return torch.stack(out)


def assert_close(ours, ref, atol=1e-5):
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=1).min().item()
    assert diff < atol and cos >= 0.99999, f"max abs diff {diff}, min cosine {cos}"


# ---------------------------------------------------------------- tiny models vs HF


@pytest.mark.parametrize(
    "kind,pooling,act",
    [("bert", "mean", "gelu"), ("bert", "cls", "gelu"), ("bert", "mean", "gelu_new"),
     ("bert-mlm", "mean", "gelu"), ("xlm-roberta", "cls", "gelu")],
)
def test_tiny_matches_hf(tmp_path, kind, pooling, act):
    hf = make_tiny(tmp_path / "m", kind, pooling, act)
    model = load_model(str(tmp_path / "m"))
    assert model.spec.pooling == pooling and model.spec.max_tokens == 64
    seqs, ids, cu, max_len = random_batch(LENGTHS)
    with torch.inference_mode():
        ours = model(ids, cu, max_len)
        ours32 = model(ids.int(), cu, max_len)  # int32 ids, as the shared-memory ring carries them
    assert_close(ours, hf_pooled(hf, seqs, pooling))
    assert torch.equal(ours, ours32)


def test_sharded_checkpoint_matches(tmp_path):
    hf = make_tiny(tmp_path / "m", max_shard_size="20KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 2
    model = load_model(str(tmp_path / "m"))
    seqs, ids, cu, max_len = random_batch(LENGTHS)
    with torch.inference_mode():
        assert_close(model(ids, cu, max_len), hf_pooled(hf, seqs, "mean"))


def test_bf16_and_thread_count(tmp_path):
    make_tiny(tmp_path / "m")
    seqs, ids, cu, max_len = random_batch(LENGTHS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker sets its thread count before loading
    try:
        with torch.inference_mode():
            ref = load_model(str(tmp_path / "m"))(ids, cu, max_len)
            bf16 = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)(ids, cu, max_len)
    finally:
        torch.set_num_threads(threads)
    assert bf16.dtype == torch.float32  # pooled output is float32 whatever the weights
    assert torch.nn.functional.cosine_similarity(bf16, ref).min() > 0.99


def test_too_long_sequence_is_refused(tmp_path):
    make_tiny(tmp_path / "m")
    model = load_model(str(tmp_path / "m"))
    _, ids, cu, max_len = random_batch([65])
    with pytest.raises(ValueError, match="65 tokens"):
        model(ids, cu, max_len)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["encoder.layer.1.attention.self.key.weight"]
    save_file(tensors, str(file))
    with pytest.raises(UnsupportedModel, match=r"encoder\.layer\.1\.attention\.self\.key\.weight"):
        load_model(str(tmp_path / "m"))


# ---------------------------------------------------------------- packing helpers


def test_positions_pool_and_attention_helpers():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # includes an empty sequence
    assert positions(cu, 5).tolist() == [0, 1, 2, 0, 1]
    h = torch.arange(10, dtype=torch.float32).view(5, 2)
    assert pool(h, cu, "cls")[[0, 2]].tolist() == [[0, 1], [6, 7]]
    assert pool(h, cu, "last")[[0, 2]].tolist() == [[4, 5], [8, 9]]
    assert pool(h, cu, "mean").tolist() == [[2, 3], [0, 0], [7, 8]]

    # Causal varlen attention (for decoder families) equals per-sequence masked attention.
    torch.manual_seed(0)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, 2, 8) for _ in range(3))
    out = VarlenAttention("sdpa_loop")(q, k, v, cu, 5, causal=True)
    for s, e in ((0, 4), (4, 9)):
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) / 8**0.5
        scores = scores.masked_fill(torch.ones(e - s, e - s).triu(1).bool(), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e])
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- real all-MiniLM-L6-v2 vs sentence-transformers

TEXTS = [
    "hello", "Hello, world!", "", "   ", "a", "The cat sat on the mat.",
    "Embeddings map text to vectors so that similar meanings end up close together.",
    "naïve café résumé coöperate façade", "Straße, Größe, Fuß", "ÀÉÎÕÜ àéîõü ñ ç",
    "🙂", "I love pizza 🍕🍕🍕 and 🎉 parties!", "👩‍👩‍👧‍👦 family emoji with ZWJ",
    "東京は日本の首都です。", "我喜欢自然语言处理。", "한국어 문장도 있습니다.", "日本語とEnglishのmix",
    "Привет, как дела?", "Γειά σου κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "ส วั ส ดี", "tabs\tand\nnewlines\r\nmixed", "ALL CAPS SHOUTING TEXT", "MiXeD cAsE wOrDs",
    "1234567890 3.14159 2.71828 1e-9", "https://example.com/path?query=1&x=y#frag",
    "user@example.com wrote: <b>bold</b> & 'quotes' \"double\"", "def f(x): return x ** 2  # code",
    "SELECT * FROM table WHERE id = 42;", "¯\\_(ツ)_/¯", "∑ ∫ √ ∞ ≠ ≤ ≥ π", "zero\u200bwidth space",
    "supercalifragilisticexpialidocious", "antidisestablishmentarianism pneumonoultramicroscopic",
    "The quick brown fox jumps over the lazy dog.", "A man is eating food.", "A man is riding a horse.",
    "Two people are playing chess in the park.", "Weather today: sunny, 25°C, light wind from NW.",
    "What is the capital of France?", "Paris is the capital and most populous city of France.",
    "!!!???...", "word " * 100, "x" * 500,
    " ".join(f"token{i}" for i in range(300)),  # far over 256 tokens: truncated
    "Long document. " + "The history of natural language processing generally started in the 1950s. " * 30,
    "[CLS] literal special tokens [SEP] inside text [PAD]", "end with space ",
]


@pytest.fixture(scope="module")
def minilm():
    return load_model(default_model_path())


def tokenize(texts, max_tokens):
    """What the frontend does: tokenizer.json without its padding/truncation, [CLS] ... [SEP] kept."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(default_model_path(), "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    out = []
    for text in texts:
        enc = tok.encode(text, add_special_tokens=False)
        enc.truncate(max_tokens - tok.num_special_tokens_to_add(False))
        out.append(tok.post_process(enc).ids)
    return out


def test_minilm_spec():
    spec = read_model_spec(default_model_path())
    assert spec.family == "bert" and spec.name
    assert (spec.hidden_size, spec.max_tokens, spec.vocab_size) == (384, 256, 30522)
    assert spec.pooling == "mean"


def test_minilm_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(default_model_path(), device="cpu").encode(TEXTS, normalize_embeddings=True)
    seqs = tokenize(TEXTS, minilm.spec.max_tokens)
    assert max(len(s) for s in seqs) == 256  # the long texts really were truncated
    with torch.inference_mode():
        ours = torch.nn.functional.normalize(minilm(*pack(seqs)), dim=1)
    cos = (ours * torch.from_numpy(ref)).sum(1)
    worst = cos.argmin().item()
    assert cos.min() >= 0.9999, f"text {worst} {TEXTS[worst][:40]!r}: cosine {cos[worst]}"


# ---------------------------------------------------------------- spec errors


@pytest.fixture
def tiny_dir(tmp_path):
    make_tiny(tmp_path / "m")
    return tmp_path / "m"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_not_a_directory(tmp_path):
    with pytest.raises(UnsupportedModel, match="not a directory"):
        read_model_spec(str(tmp_path / "nope"))


def test_no_config(tmp_path):
    with pytest.raises(UnsupportedModel, match="no config.json") as e:
        read_model_spec(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_unknown_model_type(tiny_dir):
    edit_config(tiny_dir, model_type="gpt2")
    with pytest.raises(UnsupportedModel, match=r"'gpt2' is not supported; supported: .*bert"):
        read_model_spec(str(tiny_dir))


def test_no_safetensors(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModel, match=r"no \*\.safetensors weights"):
        read_model_spec(str(tiny_dir))
    (tiny_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModel, match=r"\.bin-only checkpoints are unsupported"):
        read_model_spec(str(tiny_dir))


@pytest.mark.parametrize(
    "change,message",
    [({"hidden_act": "relu"}, "hidden_act 'relu'"),
     ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'")],
)
def test_unsupported_config(tiny_dir, change, message):
    edit_config(tiny_dir, **change)
    with pytest.raises(UnsupportedModel, match=message):
        read_model_spec(str(tiny_dir))


def test_unsupported_pooling_and_modules(tiny_dir):
    write_st_files(tiny_dir, pooling="max")
    with pytest.raises(UnsupportedModel, match="pooling mode 'max'"):
        read_model_spec(str(tiny_dir))
    layer_norm = {"idx": 3, "name": "3", "path": "3_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}
    write_st_files(tiny_dir, normalize=False, extra_modules=[layer_norm])
    with pytest.raises(UnsupportedModel, match="module 'sentence_transformers.models.LayerNorm' is not supported"):
        read_model_spec(str(tiny_dir))


def test_mean_pooling_without_the_prompt_is_refused(tiny_dir):
    """include_prompt false: sentence-transformers leaves a prompt's tokens out of the mean, which
    pollen does not; CLS and last-token pooling do not read them, so those stay served."""
    cfg = json.loads((tiny_dir / "1_Pooling" / "config.json").read_text())
    (tiny_dir / "1_Pooling" / "config.json").write_text(json.dumps({**cfg, "include_prompt": False}))
    with pytest.raises(UnsupportedModel, match="include_prompt false"):
        read_model_spec(str(tiny_dir))
    assert read_model_spec(str(tiny_dir), pooling="cls").pooling == "cls"


def test_spec_defaults_without_sentence_transformers_files(tiny_dir):
    shutil.rmtree(tiny_dir / "1_Pooling")
    (tiny_dir / "modules.json").unlink()
    spec = read_model_spec(str(tiny_dir))
    assert (spec.pooling, spec.max_tokens, spec.hidden_size) == ("mean", 64, 32)
    (tiny_dir / "1_Pooling").mkdir()  # the new sentence-transformers form of the pooling config
    (tiny_dir / "1_Pooling" / "config.json").write_text('{"pooling_mode": "lasttoken"}')
    assert read_model_spec(str(tiny_dir)).pooling == "last"


def test_spec_module_does_not_import_torch():
    code = "import sys, pollen.common.model_spec; assert 'torch' not in sys.modules, 'torch imported'"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
