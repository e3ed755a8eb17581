"""A rerank pair's token ids (server/tasks/rerank.py) against the HF tokenizer's own encoding of the
pair (transformers' fast tokenizer of the real all-MiniLM-L6-v2 files, `truncation="only_second"`:
the document is cut, never the query), and Qwen3-Reranker's against its model card's recipe (a
Qwen3-regex byte-level BPE trained here, and the real Qwen3 file where POLLEN_QWEN3_TOKENIZER
names it), with tokie on and off.

The documents include ones tokie is given whole in one call (server/pipeline/tokenizer.py
first_ids_flat), ones it holds back (DEL), ones cut to the room, and ones of words too long for
the vocabulary (one [UNK] each, far more characters a token than the first piece tokenized
assumes, so they take the longer pieces)."""
from __future__ import annotations

import numpy as np
import pytest

from pollen.common.errors import RequestError
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.server.tasks.rerank import PairBuilder
from pollen.v1 import embedder_pb2 as pb
from tests.st_models import copy_bert_tokenizer

QUERY = "how do bees make honey"
TYPE_OFFSET = 30522  # a type-1 token travels as its id plus the vocabulary size (worker/models/bert.py)
DOCS = ["Bees collect nectar and store it in the hive, where it thickens into honey.",
        "honey " * 500,
        ("a" * 120 + " ") * 30,
        ("a" * 120 + " ") * 10 + "Honey bees live in colonies with one queen. " * 20,
        ("b" * 110 + " ") * 300,
        "Nectar is evaporated by fanning wings \x7f until it becomes honey. " * 40,
        "東京の蜂蜜は美味しい。" * 100,
        "x"]


class Spec:
    reranker_template = False
    type_offset = TYPE_OFFSET


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("minilm-tokenizer")
    copy_bert_tokenizer(path)
    return str(path)


def expected(folder: str, limit: int) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for doc in DOCS:
        enc = tok(QUERY, doc, truncation="only_second", max_length=limit)
        out.append(np.asarray(enc["input_ids"]) + TYPE_OFFSET * np.asarray(enc["token_type_ids"]))
    return out


def served_pairs(tokenizer: TextTokenizer, frame) -> dict[int, np.ndarray]:
    """DOCS' pairs as a Ranker makes them (Ranker.document_pairs): those PairFrame.tokie_pairs
    takes, then the others apart, each named by its index in DOCS."""
    ours = dict(zip(*frame.tokie_pairs(tokenizer, DOCS))) if tokenizer.tokie is not None else {}
    rest = [i for i in range(len(DOCS)) if i not in ours]
    ours.update(zip(rest, frame.pairs(tokenizer, [DOCS[i] for i in rest], rest)))
    return ours


@pytest.mark.parametrize("tokie", [True, False])
@pytest.mark.parametrize("limit", [128, 512])
def test_pairs_are_the_hf_tokenizers_pair_encoding(folder, tokie, limit):
    tokenizer = TextTokenizer(folder, 512, tokie=tokie)
    frame = PairBuilder(Spec, tokenizer).frame(QUERY, "", limit, pb.TRUNCATE_END)
    assert not tokie or tokenizer.tokie.held(DOCS) == {5}  # DEL is held back from tokie
    ours = served_pairs(tokenizer, frame)
    for i, want in enumerate(expected(folder, limit)):
        assert ours[i].tolist() == want.tolist(), f"documents[{i}]"


def test_a_document_over_the_room_is_refused_by_its_index(folder):
    tokenizer = TextTokenizer(folder, 512, tokie=True)
    frame = PairBuilder(Spec, tokenizer).frame(QUERY, "", 128, pb.TRUNCATE_NONE)
    with pytest.raises(RequestError, match=r"documents\[7\] has more than the 120 tokens"):
        frame.text_pairs(tokenizer, ["x", "honey " * 500], [3, 7], covered=True)


class Qwen3Spec:
    reranker_template = True
    type_offset = 0


@pytest.fixture(scope="module", params=["trained", "qwen3-real"])
def qwen3_folder(request, tmp_path_factory):
    """A byte-level BPE on Qwen3's pre-tokenizer regex (trained here), or the real Qwen3 file."""
    import os
    import shutil

    from tests.test_ascii_bpe import QWEN3, train

    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    if request.param == "trained":
        train(QWEN3).save(str(path / "tokenizer.json"))
    elif os.environ.get("POLLEN_QWEN3_TOKENIZER"):
        shutil.copy(os.environ["POLLEN_QWEN3_TOKENIZER"], path / "tokenizer.json")
    else:
        pytest.skip("needs POLLEN_QWEN3_TOKENIZER (the real Qwen3 tokenizer.json, which load/run_gpu.sh needs)")
    return str(path)


@pytest.mark.parametrize("tokie", [True, False])
def test_qwen3_reranker_pairs_are_the_model_cards_prompt(qwen3_folder, tokie):
    """Qwen3-Reranker's pairs against its model card's recipe: the prefix's ids, the formatted
    `<Instruct>: ...\\n<Query>: ...\\n<Document>: doc` cut to what the limit leaves, the suffix's."""
    from tokenizers import Tokenizer

    from pollen.server.tasks.rerank import QWEN3_DEFAULT_INSTRUCTION, QWEN3_PREFIX, QWEN3_SUFFIX

    tok = Tokenizer.from_file(f"{qwen3_folder}/tokenizer.json")
    prefix, suffix = (tok.encode(t, add_special_tokens=False).ids for t in (QWEN3_PREFIX, QWEN3_SUFFIX))
    limit = len(prefix) + len(suffix) + 200  # the trained file spells the chat tokens out byte by byte
    tokenizer = TextTokenizer(qwen3_folder, 4096, tokie=tokie)
    frame = PairBuilder(Qwen3Spec, tokenizer).frame(QUERY, "", limit, pb.TRUNCATE_END)
    ours = served_pairs(tokenizer, frame)
    for i, doc in enumerate(DOCS):
        body = tok.encode(f"<Instruct>: {QWEN3_DEFAULT_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}",
                          add_special_tokens=False).ids
        want = prefix + body[:limit - len(prefix) - len(suffix)] + suffix
        assert ours[i].tolist() == want, f"documents[{i}]"
