"""API keys over both doors, on real servers: HTTP 401 (OpenAI-style, WWW-Authenticate) and gRPC
UNAUTHENTICATED without a valid key, unary and stream; health open; /metrics open unless
--metrics-auth; the Python client, `pollen embed` and the openai client with the key; keys
never in a log, an answer or a child's command line."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pollen.server import auth
from pollen.server.config import ServeConfig
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, free_port

KEYS = ("key-one-4f7c2a9e", "key-two-b81d03c5")
FILE_KEY = "file-key-77e0c1d2"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with two keys from POLLEN_API_KEY, its log in a file."""
    log = tmp_path_factory.mktemp("auth") / "serve.log"
    srv = ServerProcess(env={"POLLEN_API_KEY": ",".join(KEYS)}, log=str(log)).start()
    yield srv, log
    assert srv.terminate() == 0


def http(server, path: str, body: dict | None = None, key: str | None = None, scheme: str = "Bearer"):
    """(status, headers, JSON or text body) of one request."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    request = urllib.request.Request(f"http://{server.http_listen}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, reply_headers, text = reply.status, reply.headers, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, reply_headers, text = exc.code, exc.headers, exc.read().decode()
    try:
        return status, reply_headers, json.loads(text)
    except ValueError:
        return status, reply_headers, text


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def test_http_without_a_valid_key_is_401(keyed):
    server, _ = keyed
    body = {"input": ["hello"]}
    status, headers, answer = http(server, "/v1/embeddings", body)
    assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="pollen"'
    assert answer["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in answer["error"]["message"]
    for key, scheme in (("wrong-key", "Bearer"), (KEYS[0] + "x", "Bearer"), (KEYS[0], "Basic"), ("", "Bearer")):
        status, headers, answer = http(server, "/v1/embeddings", body, key, scheme)
        assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="pollen", error="invalid_token"'
        assert answer["error"]["type"] == "invalid_request_error" and KEYS[0] not in json.dumps(answer)
    assert http(server, "/v1/models")[0] == 401


def test_http_with_either_key_is_served_and_health_and_metrics_stay_open(keyed):
    server, _ = keyed
    for key in KEYS:
        status, _, answer = http(server, "/v1/embeddings", {"input": ["hello"]}, key)
        assert status == 200 and len(answer["data"][0]["embedding"]) == 384
    assert http(server, "/v1/embeddings", {"input": "hi"}, KEYS[1], scheme="bearer")[0] == 200
    assert http(server, "/v1/models", key=KEYS[0])[0] == 200
    status, _, answer = http(server, "/health")
    assert (status, answer) == (200, {"status": "SERVING"})
    status, _, text = http(server, "/metrics")
    assert status == 200 and 'pollen_requests_total{door="http",outcome="UNAUTHENTICATED",task="embed"}' in text


def test_grpc_without_a_valid_key_is_unauthenticated_unary_and_stream(keyed):
    server, _ = keyed
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        calls = [lambda m: stub.Embed(pb.EmbedRequest(texts=["x"]), metadata=m, timeout=30),
                 lambda m: stub.Info(pb.InfoRequest(), metadata=m, timeout=30),
                 lambda m: stub.Tokenize(pb.TokenizeRequest(texts=["x"]), metadata=m, timeout=30),
                 lambda m: list(stub.EmbedStream(iter([pb.EmbedRequest(id="1", texts=["x"])]), metadata=m,
                                                 timeout=30))]
        for metadata in (None, bearer("wrong-key"), (("authorization", KEYS[0]),)):
            for call in calls:
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert KEYS[0] not in refused.value.details()
        # Health needs no key.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_with_the_key_is_served_unary_and_stream(keyed):
    server, _ = keyed
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        reply = stub.Embed(pb.EmbedRequest(texts=["x", "y"]), metadata=bearer(KEYS[0]), timeout=60)
        assert (reply.rows, reply.dims) == (2, 384)
        answers = list(stub.EmbedStream(iter([pb.EmbedRequest(id=str(i), texts=["x"]) for i in range(5)]),
                                        metadata=bearer(KEYS[1]), timeout=60))
        assert sorted(a.id for a in answers) == [str(i) for i in range(5)]
        assert all(a.rows == 1 and not a.HasField("error") for a in answers)
        info = stub.Info(pb.InfoRequest(), metadata=bearer(KEYS[1]), timeout=30)
        assert KEYS[0] not in str(info) and KEYS[1] not in str(info)


def test_teis_grpc_api_is_behind_the_keys(keyed):
    """tei.v1's methods, unary and stream, refused without a key as pollen.v1's are; served with one."""
    tei_stubs = pytest.importorskip("tei_client.stubs")
    tei, tei_grpc = tei_stubs.tei_pb2, tei_stubs.tei_pb2_grpc
    server, _ = keyed
    with grpc.insecure_channel(server.listen) as channel:
        embed, info = tei_grpc.EmbedStub(channel), tei_grpc.InfoStub(channel)
        calls = [lambda m: embed.Embed(tei.EmbedRequest(inputs="x"), metadata=m, timeout=30),
                 lambda m: info.Info(tei.InfoRequest(), metadata=m, timeout=30),
                 lambda m: list(embed.EmbedStream(iter([tei.EmbedRequest(inputs="x")]), metadata=m, timeout=30))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call(bearer("wrong-key"))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(calls[0](bearer(KEYS[0])).embeddings) == 384
        assert len(calls[2](bearer(KEYS[1]))[0].embeddings) == 384


def test_teis_routes_of_one_model_are_behind_the_keys_before_a_name_is_looked_up(keyed):
    """/models/<name>/: 401 without a key whether the name is served or not (a 404 would tell
    which names are); with one, the model's routes, and 404 for a name no model has."""
    server, _ = keyed
    name = http(server, "/v1/models", key=KEYS[0])[2]["data"][0]["id"]
    for path in (f"/models/{name}/info", "/models/nope/info"):
        assert http(server, path)[0] == 401, path
    status, _, info = http(server, f"/models/{name}/info", key=KEYS[1])
    assert status == 200 and info["model_id"] == name
    assert http(server, "/models/nope/info", key=KEYS[0])[0] == 404


def test_the_clients_send_the_key(keyed):
    from pollen.client import AsyncClient, Client, EmbedError

    server, _ = keyed
    with Client(server.listen, api_key=KEYS[0]) as client:
        assert client.embed(["a", "b"]).shape == (2, 384)
        assert [v.shape for v in client.embed_stream(["a", "b", "c"], in_flight=2)] == [(384,)] * 3
    with Client(server.listen) as client, pytest.raises(EmbedError) as refused:
        client.embed(["a"])
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED

    async def embed_async():
        async with AsyncClient(server.listen, api_key=KEYS[1]) as client:
            streamed = [v async for v in client.embed_stream(["a", "b"])]
            return (await client.embed(["a"])).shape, len(streamed)

    assert asyncio.run(embed_async()) == ((1, 384), 2)


def test_the_async_stream_without_a_valid_key_says_unauthenticated_every_time(keyed):
    # The server refuses the stream at once; the client's writes then race the refusal, and a
    # write that loses makes grpc.aio report a bare INTERNAL (grpc/grpc#36066) unless the client
    # asks the server what is wrong (client/aio.py _probe).
    from pollen.client import AsyncClient, EmbedError

    server, _ = keyed

    async def attempts():
        codes = []
        async with AsyncClient(server.listen, api_key="not-a-key") as client:
            for _ in range(20):
                try:
                    async for _vector in client.embed_stream([f"text {i}" for i in range(64)], in_flight=32):
                        pass
                except EmbedError as exc:
                    codes.append(exc.code)
        return codes

    assert asyncio.run(attempts()) == [grpc.StatusCode.UNAUTHENTICATED] * 20


def test_pollen_embed_takes_the_key(keyed):
    server, _ = keyed

    def embed(*args, env=None):
        environ = {k: v for k, v in os.environ.items() if k != "POLLEN_API_KEY"} | (env or {})
        return subprocess.run([POLLEN, "embed", "--server", server.listen, "hello", *args], check=False, env=environ,
                              capture_output=True, text=True, timeout=120)

    run = embed(env={"POLLEN_API_KEY": ",".join(KEYS)})  # the server's own variable: its first key is used
    assert run.returncode == 0 and len(json.loads(run.stdout)["embeddings"][0]) == 384
    assert embed("--api-key", KEYS[1]).returncode == 0
    run = embed("--api-key", "wrong-key")
    assert run.returncode == 1 and "UNAUTHENTICATED" in run.stderr and "wrong-key" not in run.stderr


def test_the_openai_client_with_and_without_the_key(keyed):
    import openai

    server, _ = keyed
    client = openai.OpenAI(base_url=f"http://{server.http_listen}/v1", api_key=KEYS[0], max_retries=0)
    assert len(client.embeddings.create(model="x", input=["hello"]).data[0].embedding) == 384
    wrong = openai.OpenAI(base_url=f"http://{server.http_listen}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model="x", input=["hello"])


def test_keys_are_never_logged(keyed):
    server, log = keyed
    http(server, "/v1/embeddings", {"input": "x"}, "a-wrong-key-for-the-log")
    with grpc.insecure_channel(server.listen) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["x"]), metadata=bearer("wrong-grpc-key"))
    text = log.read_text()
    assert "API keys: 2" in text and "refused UNAUTHENTICATED" in text
    for secret in (*KEYS, "a-wrong-key-for-the-log", "wrong-grpc-key"):
        assert secret not in text


def test_keys_reach_no_command_line_and_no_worker(keyed):
    server, _ = keyed
    for pid in server.child_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert not any(k.encode() in cmdline for k in KEYS)
        if cmdline.startswith(b"pollen-worker["):  # the worker serves no door and gets no key
            assert not any(k.encode() in environ for k in KEYS)


def test_metrics_auth_and_a_key_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated 2026-12\n\n{FILE_KEY}\n")
    server = ServerProcess("--api-key-file", str(keys), "--metrics-auth").start()
    try:
        assert http(server, "/metrics")[0] == 401
        assert http(server, "/metrics", key=FILE_KEY)[0] == 200
        assert http(server, "/health")[0] == 200
        assert http(server, "/v1/embeddings", {"input": "x"}, FILE_KEY)[0] == 200
    finally:
        assert server.terminate() == 0


def test_bad_key_settings_fail_at_start_without_quoting_a_key(tmp_path):
    def serve(*args):
        return subprocess.run([POLLEN, "serve", "--listen", f"127.0.0.1:{free_port()}", "--http-listen", "", *args],
                              check=False, env=os.environ, capture_output=True, text=True, timeout=120)

    empty = tmp_path / "empty"
    empty.write_text("# no keys yet\n")
    cases = [(("--api-key", "good-key,bad key"), "--api-key (or POLLEN_API_KEY): key 2 holds a character"),
             (("--api-key", " , "), "--api-key (or POLLEN_API_KEY) is set but holds no key"),
             (("--api-key-file", str(empty)), "holds no key"),
             (("--api-key-file", str(tmp_path / "missing")), "cannot read it"),
             (("--metrics-auth",), "--metrics-auth needs API keys")]
    for args, message in cases:
        run = serve(*args)
        assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert "bad key" not in run.stderr


def test_keys_stay_off_the_config_children_get():
    cfg = ServeConfig.from_args(["--metrics-auth"], environ={"POLLEN_API_KEY": KEYS[0]})
    assert cfg.api_key == KEYS[0] and cfg.metrics_auth is True
    assert cfg.to_dict()["api_key"] is None and KEYS[0] not in repr(cfg)
    assert ServeConfig.from_args(["--metrics-auth", "0"], environ={"POLLEN_METRICS_AUTH": "1"}).metrics_auth is False


def test_api_keys_check_bearer_tokens():
    keys = auth.ApiKeys(list(KEYS))
    assert len(keys) == 2 and KEYS[0] not in repr(keys)
    assert keys.check(f"Bearer {KEYS[0]}") is None and keys.check(f"bearer  {KEYS[1]} ") is None
    assert keys.check(None) == "this server needs an API key: send it as Authorization: Bearer KEY"
    assert keys.check(f"Basic {KEYS[0]}") == keys.check("Bearer ") == keys.check(KEYS[0]) \
        == "the Authorization header (or metadata) must be Bearer KEY"
    assert keys.check(f"Bearer {KEYS[0][:-1]}") == keys.check(f"Bearer {KEYS[0]}, Bearer x") \
        == "the API key is not valid"
    assert not auth.ApiKeys([]) and auth.read_keys(None, None) == []
