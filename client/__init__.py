"""pollen's Python client: `Client` (blocking) and `AsyncClient` (asyncio) over gRPC.

    from pollen.client import Client
    with Client("127.0.0.1:50051") as client:
        vectors = client.embed(["hello", "world"], dimensions=128)        # numpy (2, 128) float32
        vectors.model                                                     # the served model that answered
        for vector in client.embed_stream(texts, in_flight=32):           # input order, reconnecting
            ...
"""
from pollen.client.aio import AsyncClient
from pollen.client.client import Client
from pollen.client.messages import EmbedError, Results, ScaledInt8Array, Vectors, build_request, decode

__all__ = ["AsyncClient", "Client", "EmbedError", "Results", "ScaledInt8Array", "Vectors", "build_request", "decode"]
