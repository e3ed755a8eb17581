"""A request's tokenization is bounded by what the model can see (docs/design/bounds.md, "Bounds"):
prompts are capped, long texts are cut before they are tokenized, and the ids stay exactly
those of tokenizing the prompt and the whole text together."""
from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pollen.common.errors import RequestError
from pollen.common.model_spec import default_model_path
from pollen.server.pipeline.tokenizer import PROMPT_MAX_CHARS, TextTokenizer
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

# The frontend's peak RSS may grow by at most this much while it serves the requests below
# (docs/design/bounds.md, "Bounds").
RSS_BOUND_MB = 100
ANSWER_WITHIN_S = 10.0

# Words of 101 letters are one [UNK] each: the most characters a prompt can carry for its tokens.
UNK_PROMPT = (("x" * 101 + " ") * 41)[:PROMPT_MAX_CHARS]


def memory_mb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> None:
    """VmHWM := VmRSS, so that VmHWM is from now on the peak of what follows."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


@pytest.fixture(scope="module")
def full_server():
    """The default limits: 512 texts a request, 8 MiB a message."""
    srv = ServerProcess("--log-level", "WARNING").start()
    yield srv
    assert srv.terminate() == 0


def test_prompt_amplification_stays_under_the_memory_bound(full_server):
    texts = ["a short text"] * 512  # 7 KiB
    amplifying = [  # the prompt, copied to each of 512 texts, would be megabytes of tokenizer input
        pb.EmbedRequest(texts=texts, prompt="Represent this: " * 750, truncate=pb.TRUNCATE_END),  # 18 KiB
        pb.EmbedRequest(texts=texts, prompt="q " * (251 << 9), truncate=pb.TRUNCATE_END),         # 258 KiB
    ]
    assert [r.ByteSize() >> 10 for r in amplifying] == [18, 258]
    # The most a prompt may cost (512 x 4096 characters), with short texts and with 258 KiB of
    # texts cut to the limit. Tokenize takes the same path as Embed, without the model's time.
    admitted = [pb.TokenizeRequest(texts=texts, prompt=UNK_PROMPT),
                pb.TokenizeRequest(texts=["!" * 505] * 512, prompt=UNK_PROMPT, truncate=pb.TRUNCATE_END)]
    assert admitted[1].ByteSize() >> 10 == 258
    pid = full_server.pid
    with grpc.insecure_channel(full_server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        stub.Embed(pb.EmbedRequest(texts=["warm up"]), timeout=30)
        before = memory_mb(pid)["VmRSS"]
        reset_peak(pid)
        for request in amplifying:
            for call, message in ((stub.Embed, request),
                                  (stub.Tokenize, pb.TokenizeRequest(texts=request.texts, prompt=request.prompt,
                                                                   truncate=pb.TRUNCATE_END))):
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    call(message, timeout=ANSWER_WITHIN_S)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert err.value.details().startswith("prompt has")
                assert f"over the limit of {PROMPT_MAX_CHARS}" in err.value.details()
                assert time.monotonic() - t0 < ANSWER_WITHIN_S
        short = len(raw_tokenizer().encode(UNK_PROMPT + texts[0]).ids)
        for request, tokens in zip(admitted, (short, 256)):
            t0 = time.monotonic()
            reply = stub.Tokenize(request, timeout=ANSWER_WITHIN_S)
            assert time.monotonic() - t0 < ANSWER_WITHIN_S
            assert list(reply.counts) == [tokens] * 512
        after = memory_mb(pid)["VmHWM"]
    print(f"frontend RSS {before} MB before, peak {after} MB")
    assert after - before < RSS_BOUND_MB


def raw_tokenizer() -> Tokenizer:
    """The model's tokenizer.json as it is, without its own truncation (128 tokens) and padding."""
    raw = Tokenizer.from_file(f"{default_model_path()}/tokenizer.json")
    raw.no_truncation()
    raw.no_padding()
    return raw


@pytest.fixture(scope="module")
def tokenizers():
    raw = raw_tokenizer()
    # Tiny pieces, so that texts are cut at every few characters.
    return TextTokenizer(default_model_path(), 256, chars_per_token=1, piece_chars=5, group_chars=64), raw


def reference(raw: Tokenizer, text: str, truncate: int, room: int) -> list[int] | None:
    """The whole text tokenized at once, then cut and given its special tokens: what
    sentence-transformers does (None: too long for TRUNCATE_NONE)."""
    enc = raw.encode(text, add_special_tokens=False)
    if len(enc.ids) > room:
        if truncate == pb.TRUNCATE_NONE:
            return None
        enc.truncate(room, direction="right" if truncate == pb.TRUNCATE_END else "left")
    return raw.post_process(enc).ids


# Characters around every cut point and the tokenizer's corner cases: separators, CJK, accents
# (stripped by the normalizer), control characters (removed), non-ASCII spaces and punctuation,
# a word too long for WordPiece (one [UNK]), and special tokens written in the text (each one
# token, though made of punctuation and letters).
PIECES = st.sampled_from(["a", "b", "word", "Ünï", " ", "  ", "\t", "\n", ".", ",", "!", "-", "東", "京",
                          "あ", "\u0301", "\x00", "\x1c", "\u00a0", "\u3000", "\u3001", "\uff0c", "\u2014",
                          "🙂", "İ", "ﬁ", "x" * 120, "[MASK]", "[SEP]", "[UNK]", "[CLS]"])


@settings(derandomize=True, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.sampled_from(["", "query: ", "abc", "東", "passage:"]),
       text=st.lists(PIECES, min_size=1, max_size=40).map("".join),
       repeat=st.sampled_from([1, 30, 300]),
       truncate=st.sampled_from([pb.TRUNCATE_END, pb.TRUNCATE_START, pb.TRUNCATE_NONE]),
       limit=st.sampled_from([8, 40, 256]))
def test_cut_tokenization_equals_whole_tokenization(tokenizers, prompt, text, repeat, truncate, limit):
    ours, raw = tokenizers
    text *= repeat
    room = limit - ours.special
    want = reference(raw, prompt + text, truncate, room)
    try:
        got = ours.encode([text], truncate, limit, prompt)[0].tolist()
    except RequestError as exc:
        assert want is None and "over the" in exc.message
    else:
        assert got == want
    whole = raw.encode(prompt + text, add_special_tokens=False).ids
    stride = room - room // 8
    starts = [0]
    while starts[-1] + room < len(whole):
        starts.append(starts[-1] + stride)
    windows = ours.encode_windows([text], limit, prompt)[0]
    assert [w[1:-1].tolist() for w in windows] == [whole[s:s + room] for s in starts]
