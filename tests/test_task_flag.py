"""--task: what each model serves, in place of what its checkpoint's files say. A Qwen3ForCausalLM
copied into a folder whose name does not say "reranker" is served as Qwen3-Reranker with
--task rerank (scores against the model card's recipe computed with transformers), and as an
embedder with auto, as before (vectors against transformers' last hidden state); a task the
checkpoint cannot serve is refused at start in one line naming the model and the flag; the
start-up log says each model's task and why; the flag repeats like --model."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import shutil
import subprocess

import grpc
import numpy as np
import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.common.worker_config import WorkerConfig
from pollen.server.config import ServeConfig
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess
from tests.test_rerank_models import (
    RERANK_CASES,
    make_encoder_classifier,
    prompt,
    qwen3_config,
    randomize,
    save_reranker_tokenizer,
)

# Words of the reranker tokenizer's vocabulary (tests/test_rerank_models.py), one text to embed.
TEXT = "what is the capital of China?"


# ---------------------------------------------------------------- the flag


def test_task_repeats_like_model_and_reaches_the_workers():
    cfg = ServeConfig.from_args(["--model", "a", "--model", "b", "--task", "rerank", "--task", "auto",
                                 "--max-batch-tokens", "1024"], environ={})
    assert cfg.tasks() == ["rerank", "auto"]
    worker = WorkerConfig(**json.loads(WorkerConfig.of(cfg, 0, control_fd=3, state="s", cpu_cores=[]).to_json()))
    assert [worker.task_of(0), worker.task_of(1)] == ["rerank", "auto"]
    cfg = ServeConfig.from_args([], environ={"POLLEN_MODEL": "a,b", "POLLEN_TASK": "auto,classify"})
    assert cfg.tasks() == ["auto", "classify"]
    assert ServeConfig.from_args(["--task", "embed"], environ={"POLLEN_TASK": "rerank"}).tasks() == ["embed"]
    # One value is every model's; none is auto.
    assert ServeConfig.from_args(["--model", "a", "--model", "b", "--task", "rerank"], environ={}).tasks() == [
        "rerank", "rerank"]
    assert ServeConfig.from_args(["--model", "a", "--model", "b"], environ={}).tasks() == ["auto", "auto"]
    with pytest.raises(ValueError, match="--task gives 3 values for 2 models: give one for all, or one for each"):
        ServeConfig.from_args(["--model", "a", "--model", "b", "--task", "rerank", "--task", "auto", "--task",
                               "embed"], environ={})
    with pytest.raises(ValueError, match="--task gives 2 values for 3 models"):
        ServeConfig.from_args([], environ={"POLLEN_MODEL": "a,b,c", "POLLEN_TASK": "embed,rerank"})
    with pytest.raises(ValueError, match="--task must be auto, embed, rerank or classify, got 'score'"):
        ServeConfig.from_args(["--task", "score"], environ={})


# ---------------------------------------------------------------- what a checkpoint can serve


def causal_lm(path, yes_no=True):
    """A tiny random Qwen3ForCausalLM with the reranker prompts' tokenizer; the transformers model."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    torch.manual_seed(3)
    hf = tf.Qwen3ForCausalLM(qwen3_config())
    randomize(hf)
    hf.eval().save_pretrained(str(path))
    if yes_no:
        save_reranker_tokenizer(path)
    else:
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path / "tokenizer.json"))
    return hf


def bert_embedder(path):
    import transformers as tf

    tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                               vocab_size=400, max_position_embeddings=64)).save_pretrained(str(path))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    causal_lm(root / "qwen3-ft")
    causal_lm(root / "no-yes-no", yes_no=False)
    bert_embedder(root / "bert")
    make_encoder_classifier(root / "cross-encoder", "bert", ())
    make_encoder_classifier(root / "nli", "bert", ("neg", "neutral", "pos"))
    return root


@pytest.mark.parametrize("model, task, found, reason", [
    ("qwen3-ft", "auto", "embed", "from the folder name ('qwen3-ft' does not say reranker: Qwen3ForCausalLM as an "
                                  "embedder; --task rerank serves it as Qwen3-Reranker)"),
    ("qwen3-ft", "rerank", "rerank", "from --task (Qwen3ForCausalLM as Qwen3-Reranker)"),
    ("qwen3-ft", "embed", "embed", "from --task (Qwen3ForCausalLM: no head)"),
    ("bert", "auto", "embed", "from the architecture (BertModel: no head)"),
    ("cross-encoder", "auto", "rerank", "from the head (BertForSequenceClassification, one output)"),
    ("cross-encoder", "rerank", "rerank", "from --task (BertForSequenceClassification, one output)"),
    ("nli", "auto", "classify", "from the head (BertForSequenceClassification, 3 labels)"),
])
def test_each_task_says_why(checkpoints, model, task, found, reason):
    spec = read_model_spec(str(checkpoints / model), task=task)
    assert (spec.task, spec.task_reason) == (found, reason)
    assert spec.reranker_template == (model == "qwen3-ft" and task == "rerank")


@pytest.mark.parametrize("model, task, why", [
    ("bert", "rerank", "--task rerank is refused: it has no one-output classification head and is no "
                       "Qwen3ForCausalLM to serve as Qwen3-Reranker (architectures: BertModel)"),
    ("bert", "classify", "--task classify is refused: it has no classification head with labels "
                         "(architectures: BertModel)"),
    ("qwen3-ft", "classify", "--task classify is refused: it has no classification head with labels "
                             "(architectures: Qwen3ForCausalLM)"),
    ("cross-encoder", "classify", "--task classify is refused: its BertForSequenceClassification head has one "
                                  "output, so it serves rerank"),
    ("cross-encoder", "embed", "--task embed is refused: its BertForSequenceClassification head has one output, "
                               "so it serves rerank; pollen does not serve its encoder without the head"),
    ("nli", "rerank", "--task rerank is refused: its BertForSequenceClassification head has 3 labels, so it "
                      "serves classify"),
    ("no-yes-no", "rerank", "--task rerank is refused: a Qwen3 reranker's tokenizer.json needs the tokens 'yes' "
                            "and 'no'"),
])
def test_a_task_the_checkpoint_cannot_serve_is_refused_naming_why(checkpoints, model, task, why):
    path = str(checkpoints / model)
    with pytest.raises(UnsupportedModel) as refused:
        read_model_spec(path, task=task)
    assert str(refused.value) == f"{path}: {why}"


def test_serve_and_download_refuse_an_impossible_task_in_one_line(checkpoints):
    path = str(checkpoints / "bert")
    served = subprocess.run([POLLEN, "serve", "--model", path, "--task", "classify", "--listen", "127.0.0.1:0",
                             "--http-listen", ""], capture_output=True, text=True, timeout=120)
    assert served.returncode == 1, served.stderr
    last = served.stderr.strip().splitlines()[-1]
    assert last.endswith(f"ERROR pollen: {path}: --task classify is refused: it has no classification head with "
                         "labels (architectures: BertModel)"), served.stderr
    downloaded = subprocess.run([POLLEN, "download", path, "--task", "classify"], capture_output=True, text=True,
                                timeout=120)
    assert downloaded.returncode == 1 and downloaded.stdout == ""
    assert downloaded.stderr.strip().splitlines() == [f"pollen download: {path}: --task classify is refused: it has "
                                                      "no classification head with labels (architectures: BertModel)"]


def test_bulk_refuses_a_model_that_serves_scores(checkpoints):
    from pollen.bulk.embedder import BulkEmbedder

    path = str(checkpoints / "cross-encoder")
    with pytest.raises(ValueError, match=r"pollen bulk embeds, and this model serves rerank \(from the head "
                                         r"\(BertForSequenceClassification, one output\)\)"):
        BulkEmbedder(path)


# ---------------------------------------------------------------- served


def test_a_qwen3_reranker_under_another_name_is_served_with_task_rerank(tmp_path):
    """One server: the checkpoint in a folder named "rr" with --task rerank, the same folder with
    auto (an embedder, as a Qwen3ForCausalLM not named reranker always was), and the same
    checkpoint as published, in a folder named "tiny-Qwen3-Reranker", with auto."""
    published = tmp_path / "tiny-Qwen3-Reranker"
    hf = causal_lm(published)
    copy = tmp_path / "rr"
    shutil.copytree(published, copy)
    tok = save_reranker_tokenizer(copy)
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    log = tmp_path / "server.log"
    srv = ServerProcess("--model", str(copy), "--model", str(copy), "--model", str(published),
                        "--served-model-name", "rr-rerank", "--served-model-name", "rr-auto",
                        "--served-model-name", "card", "--task", "rerank", "--task", "auto", "--task", "auto",
                        log=str(log)).start(timeout=120)
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            info = stub.Info(pb.InfoRequest(), timeout=30)
            scores = {}
            for model in ("rr-rerank", "card"):
                for instruction, query, doc in RERANK_CASES:
                    default = instruction.startswith("Given a web search query")
                    reply = stub.Rerank(pb.RerankRequest(query=query, documents=[doc], raw_scores=True, model=model,
                                                         instruction="" if default else instruction), timeout=60)
                    scores[model, instruction, query, doc] = reply.results[0].score
            embedded = stub.Embed(pb.EmbedRequest(texts=[TEXT], normalize=True, model="rr-auto"), timeout=60)
    finally:
        assert srv.terminate() == 0
    assert [(m.name, m.task, m.dimensions) for m in info.models] == [("rr-rerank", "rerank", 1), ("rr-auto", "embed", 64),
                                                                     ("card", "rerank", 1)]
    # The model card's recipe: logit("yes") - logit("no") at the last token of its whole prompt.
    for (model, instruction, query, doc), ours in scores.items():
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([tok.encode(prompt(instruction, query, doc)).ids])).logits[0, -1]
        expected = float(logits[yes] - logits[no])
        assert abs(ours - expected) <= 1e-4, (model, query, doc, ours, expected)
    # The embedder: the last token's final hidden state, normalized.
    with torch.no_grad():
        last = hf.model(input_ids=torch.tensor([tok.encode(TEXT).ids])).last_hidden_state[0, -1]
    vector = np.frombuffer(embedded.embeddings, np.float32)
    np.testing.assert_allclose(vector, (last / last.norm()).numpy(), atol=1e-4)
    text = log.read_text()
    assert "model rr-rerank: task rerank, from --task (Qwen3ForCausalLM as Qwen3-Reranker)" in text
    assert ("model rr-auto: task embed, from the folder name ('rr' does not say reranker: Qwen3ForCausalLM as an "
            "embedder; --task rerank serves it as Qwen3-Reranker)") in text
    assert ("model card: task rerank, from the folder name ('tiny-Qwen3-Reranker' says reranker: Qwen3ForCausalLM "
            "as Qwen3-Reranker)") in text
