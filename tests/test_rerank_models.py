"""Rerankers and classifiers through the real loader and the CPU engine, against independent
references: sentence-transformers' CrossEncoder (BERT, RoBERTa, XLM-R sequence classifiers),
HF's AutoModelForSequenceClassification (Qwen3) and AutoModelForCausalLM (Qwen3-Reranker's
logit("yes") - logit("no")). Tiny random checkpoints, float32, CPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import re

import numpy as np
import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.models.loader import load_model
from pollen.worker.packed import pack

WORDS = [f"w{i}" for i in range(300)]
TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# ---------------------------------------------------------------- checkpoints


def randomize(model):
    """Biases and norm weights random too (HF starts them at 0 and 1), and token types far apart,
    so a missing bias, norm or type shows in the scores."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "token_type" in name:
                p.copy_(torch.randn_like(p))


def save_word_tokenizer(path, specials, pair_template, single_template, pad, unk, inputs):
    """A word-level tokenizer over WORDS whose pair encoding follows `pair_template` (HF's
    TemplateProcessing: "$B:1" gives the second segment token type 1), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=single_template, pair=pair_template, special_tokens=[(s, vocab[s]) for s in specials if s in
                                                                    single_template + pair_template])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk, model_max_length=64,
                                   model_input_names=inputs)
    fast.save_pretrained(str(path))


def make_encoder_classifier(path, kind, labels):
    """A tiny random BERT / RoBERTa / XLM-R sequence classifier with its tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  vocab_size=400, initializer_range=0.2)
    if labels:
        common |= dict(id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    else:
        common |= dict(num_labels=1)
    if kind == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(**common, max_position_embeddings=64))
        save_word_tokenizer(path, ["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP] $B:1 [SEP]:1",
                            "[CLS] $A [SEP]", "[PAD]", "[UNK]", ["input_ids", "token_type_ids", "attention_mask"])
    else:
        cls = {"roberta": (tf.RobertaForSequenceClassification, tf.RobertaConfig),
               "xlm-roberta": (tf.XLMRobertaForSequenceClassification, tf.XLMRobertaConfig)}[kind]
        model = cls[0](cls[1](**common, max_position_embeddings=66, pad_token_id=1, type_vocab_size=1))
        save_word_tokenizer(path, ["<s>", "<pad>", "</s>", "<unk>"], "<s> $A </s> </s> $B </s>", "<s> $A </s>",
                            "<pad>", "<unk>", ["input_ids", "attention_mask"])
    randomize(model)
    model.eval().save_pretrained(str(path))
    return model


def random_pairs(n, seed=1):
    rng = np.random.default_rng(seed)
    text = lambda: " ".join(rng.choice(WORDS, size=int(rng.integers(1, 20))))  # noqa: E731
    return [(text(), text()) for _ in range(n)]


def engine_rows(model, sequences):
    """Several sequences packed into one batch through the CPU engine: [rows, output_dims]."""
    batch = pack([np.asarray(s, dtype=np.int32) for s in sequences])
    return torch.from_numpy(EagerEngine(model).submit(batch).result())


def pair_ids(tokenizer, pairs, type_offset):
    """What the frontend sends: the tokenizer's own pair encoding, second-segment ids + type_offset."""
    out = []
    for q, d in pairs:
        enc = tokenizer(q, d)
        types = enc["token_type_ids"] if type_offset else [0] * len(enc["input_ids"])
        out.append([i + type_offset * t for i, t in zip(enc["input_ids"], types)])
    return out


def assert_close(ours, ref, atol=TOLERANCE):
    ref = torch.as_tensor(np.asarray(ref), dtype=torch.float32).reshape(ours.shape)
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max abs diff {diff}"


# ---------------------------------------------------------------- encoder cross-encoders


@pytest.mark.parametrize("kind,labels", [("bert", ()), ("bert", ("neg", "neutral", "pos")),
                                         ("roberta", ()), ("xlm-roberta", ())])
def test_encoder_classifier_matches_cross_encoder(tmp_path, kind, labels):
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    make_encoder_classifier(tmp_path / "m", kind, labels)
    model = load_model(str(tmp_path / "m"))
    spec = model.spec
    assert (spec.task, spec.labels, spec.pooling) == ("classify" if labels else "rerank", labels, "cls")
    assert spec.output_dims == (len(labels) or 1)
    assert spec.type_offset == (400 if kind == "bert" else 0)

    pairs = random_pairs(7)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ids = pair_ids(tokenizer, pairs, spec.type_offset)
    logits = engine_rows(model, ids)
    assert logits.shape == (len(pairs), spec.output_dims)

    reference = CrossEncoder(str(tmp_path / "m"), device="cpu")
    # The reference sees the second segment's token types as well (BERT), or none (RoBERTa).
    assert ("token_type_ids" in reference.tokenizer(*pairs[0])) == (kind == "bert")
    assert_close(logits, reference.predict(pairs, activation_fn=torch.nn.Identity()))
    if labels:  # the frontend's softmax against CrossEncoder's
        assert_close(torch.softmax(logits, dim=1), reference.predict(pairs, apply_softmax=True))
    else:  # the frontend's sigmoid against CrossEncoder's default activation
        assert_close(torch.sigmoid(logits), reference.predict(pairs))


def test_bert_type_offset_embeds_as_hf_token_types(tmp_path):
    """word + type + position from one lookup of the summed table equals HF's embeddings, and
    the second segment's type 1 is what makes it (type 0 throughout would differ)."""
    from transformers import AutoTokenizer

    hf = make_encoder_classifier(tmp_path / "m", "bert", ())
    model = load_model(str(tmp_path / "m"))
    enc = AutoTokenizer.from_pretrained(str(tmp_path / "m"))(*random_pairs(1)[0], return_tensors="pt")
    ids, types = enc["input_ids"][0], enc["token_type_ids"][0]
    assert types.max() == 1
    positions = torch.arange(len(ids))
    with torch.no_grad():
        ref = hf.bert.embeddings(input_ids=ids[None], token_type_ids=types[None])[0]
        ours = model.emb_norm(model.word(ids + model.spec.type_offset * types) + model.position(positions))
        untyped = model.emb_norm(model.word(ids) + model.position(positions))
    assert (ours - ref).abs().max().item() <= 1e-5
    assert (untyped - ref).abs().max().item() > 1e-2


def test_missing_head_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_encoder_classifier(tmp_path / "m", "bert", ())
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["classifier.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"lacks 1 tensors: classifier\.weight"):
        load_model(str(tmp_path / "m"))


def test_embedders_keep_their_spec(tmp_path):
    """A BertModel checkpoint stays an embedder: no head, no type offset, pooled width out."""
    import transformers as tf

    tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                               vocab_size=400, max_position_embeddings=64)).save_pretrained(str(tmp_path / "e"))
    spec = read_model_spec(str(tmp_path / "e"))
    assert (spec.task, spec.type_offset, spec.output_dims, spec.labels) == ("embed", 0, 32, ())


# ---------------------------------------------------------------- Qwen3


def qwen3_config(**extra):
    import transformers as tf

    return tf.Qwen3Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=256,
                          rope_theta=5000.0, initializer_range=0.2, **extra)


@pytest.mark.parametrize("labels", [(), ("a", "b", "c")])
def test_qwen3_classifier_matches_hf(tmp_path, labels):
    import transformers as tf

    torch.manual_seed(0)
    extra = dict(id2label=dict(enumerate(labels))) if labels else dict(num_labels=1)
    hf = tf.Qwen3ForSequenceClassification(qwen3_config(**extra))
    randomize(hf)
    hf.eval().save_pretrained(str(tmp_path / "q"))
    model = load_model(str(tmp_path / "q"))
    assert (model.spec.task, model.spec.pooling, model.spec.causal) == ("classify" if labels else "rerank",
                                                                        "last", True)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (3, 17, 1, 40, 9)]
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=s[None]).logits for s in seqs])
    assert_close(engine_rows(model, seqs), ref)


SYSTEM = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
PIECES = re.compile(r"\w+|[^\w\s]|\s")
RERANK_CASES = [("Given a web search query, retrieve relevant passages that answer the query",
                 "what is the capital of China?", "The capital of China is Beijing."),
                ("Given a web search query, retrieve relevant passages that answer the query",
                 "Explain gravity", "Gravity is a force that attracts two bodies towards each other."),
                ("Judge relevance", "yes or no", "no")]


def prompt(instruction, query, doc):
    return SYSTEM + f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}" + SUFFIX


def save_reranker_tokenizer(path):
    """A word-level tokenizer.json over the prompts' words, punctuation and whitespace, with Qwen3's
    chat tokens; "yes" and "no" sit among the words, not at the vocabulary's ends."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    text = " ".join(prompt(*case) for case in RERANK_CASES)
    for special in SPECIALS:
        text = text.replace(special, " ")
    words = sorted(set(PIECES.findall(text)) | {"yes", "no"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES.pattern), behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_reranker_matches_yes_minus_no_logits(tmp_path, tied):
    import transformers as tf

    torch.manual_seed(0)
    path = tmp_path / "tiny-Qwen3-Reranker"
    hf = tf.Qwen3ForCausalLM(qwen3_config(tie_word_embeddings=tied))
    randomize(hf)
    hf.eval().save_pretrained(str(path))
    tok = save_reranker_tokenizer(path)
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")

    model = load_model(str(path))
    spec = model.spec
    assert (spec.task, spec.pooling, spec.causal, spec.reranker_template) == ("rerank", "last", True, True)
    assert spec.yes_no_ids == (yes, no) and spec.output_dims == 1
    assert model.output_head.weight.shape == (1, 64)  # folded: one row, not the vocabulary

    seqs = [tok.encode(prompt(*case)).ids for case in RERANK_CASES]
    with torch.no_grad():
        last = torch.stack([hf(input_ids=torch.tensor([s])).logits[0, -1] for s in seqs])
    assert_close(engine_rows(model, seqs), last[:, yes] - last[:, no])


def test_a_causal_lm_not_named_reranker_is_no_reranker(tmp_path):
    import transformers as tf

    tf.Qwen3ForCausalLM(qwen3_config()).save_pretrained(str(tmp_path / "tiny-qwen3"))
    save_reranker_tokenizer(tmp_path / "tiny-qwen3")
    spec = read_model_spec(str(tmp_path / "tiny-qwen3"))
    assert (spec.task, spec.reranker_template, spec.output_dims) == ("embed", False, 64)


def test_reranker_without_yes_and_no_tokens_is_refused(tmp_path):
    import transformers as tf
    from tokenizers import Tokenizer, models

    path = tmp_path / "tiny-Qwen3-Reranker"
    tf.Qwen3ForCausalLM(qwen3_config()).save_pretrained(str(path))
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path / "tokenizer.json"))
    with pytest.raises(UnsupportedModel, match="'yes' and 'no'"):
        read_model_spec(str(path))


def test_head_pooling_cannot_be_overridden(tmp_path):
    make_encoder_classifier(tmp_path / "m", "bert", ())
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == [
        "BertForSequenceClassification"]
    with pytest.raises(UnsupportedModel, match="pooling 'mean' is not offered"):
        read_model_spec(str(tmp_path / "m"), pooling="mean")
