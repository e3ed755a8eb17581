"""The CUDA engine's device-to-host copy lands in a response ring's shared-memory segment
registered with CUDA, normalized inside the graph, and equals the CPU reference; then the same
through a `pollen serve --device cuda` worker. Skipped cleanly where no GPU is visible (CI); run
on the GPU machine (load/device_gpu.sh tests tests/test_cuda_ring.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.shared_mem import records  # noqa: E402
from pollen.shared_mem.ring import Ring  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.worker.eager_engine import EagerEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from pollen.worker.postprocess import finish  # noqa: E402

HIDDEN = 32  # tests.test_model_bert.make_tiny


def cos(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()


def normalized(rows: np.ndarray) -> np.ndarray:
    out = bytearray(rows.nbytes)
    finish(np.ascontiguousarray(rows), 0, True, pb.ENCODING_FLOAT32, memoryview(out))
    return np.frombuffer(bytes(out), np.float32).reshape(rows.shape)


@pytest.fixture
def ring():
    r = Ring.create(1 << 20, prefix="pollentest")
    yield r
    r.close()
    r.unlink()


@pytest.mark.parametrize("dtype, graphs", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_d2h_lands_in_the_registered_ring_and_equals_the_cpu(tmp_path, ring, dtype, graphs):
    from pollen.worker.cuda_engine import CudaEngine
    from tests.test_model_bert import make_tiny

    make_tiny(tmp_path / "m", pooling="cls")  # cls: no atomics in pooling, so runs repeat exactly
    path = str(tmp_path / "m")
    rng = np.random.default_rng(0)
    batch = pack([rng.integers(5, 1000, n, dtype=np.int32) for n in (1, 9, 2, 40, 64, 13, 3)])
    flags = np.array([1, 0, 1, 1, 0, 1, 1], np.int32)
    cpu = EagerEngine(load_model(path)).submit(batch).result()

    engine = CudaEngine(load_model(path, "cuda", dtype), "cuda", max_batch_tokens=512, cuda_graphs=graphs)
    assert engine.runtime is not None  # the copies into the ring go straight to the CUDA runtime
    engine.warm_up()
    engine.register_host_memory(*ring.mapped_memory())
    try:
        # Two records held at once, as the worker holds batch N's and N+1's.
        held = [ring.reserve(4 * batch.rows * HIDDEN) for _ in range(2)]
        outs = [np.frombuffer(h.view, np.float32).reshape(batch.rows, HIDDEN) for h in held]
        for out in outs:
            out[:] = np.nan
            assert torch.from_numpy(out).is_pinned()  # registered: the copy is a true async DMA
        pending = [engine.submit(batch, out=outs[0], normalize=flags), engine.submit(batch, out=outs[1])]
        for p, out in zip(pending, outs):
            assert np.shares_memory(p.result(), out)
        device_normalized, raw = outs
        assert cos(raw, cpu) >= (0.99999 if dtype == torch.float32 else 0.999)
        # Normalized in the graph = postprocess.finish on the device's own rows, to float32 rounding.
        on = flags == 1
        np.testing.assert_allclose(device_normalized[on], normalized(raw[on]), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(device_normalized[~on], raw[~on], rtol=1e-6, atol=1e-7)
        expected = [bytes(out.tobytes()) for out in outs]
        for h in held:
            ring.commit(h, records.BATCH_RESULT)
        got = []
        while (item := ring.read()) is not None:
            got.append(bytes(item[1]))
        ring.release()
        assert got == expected  # the consumer reads exactly what the DMA wrote
    finally:
        engine.close()


def test_direct_copies_equal_torch_copies_and_never_overrun(tmp_path):
    """The interactive lane's copies go straight to the CUDA runtime torch loaded (worker/cudart.py):
    rows split over several buffers, as the worker splits a batch over its frontends' rings, equal
    what copy_ writes to the bit, and buffers that do not fit the rows are refused, not overrun."""
    from pollen.worker.cuda_engine import CudaEngine
    from tests.test_model_bert import make_tiny

    make_tiny(tmp_path / "m", pooling="mean")
    engine = CudaEngine(load_model(str(tmp_path / "m"), "cuda", torch.bfloat16), "cuda", max_batch_tokens=512)
    assert engine.runtime is not None and "libcudart" in engine.runtime.path
    engine.warm_up()
    rng = np.random.default_rng(3)
    batch = pack([rng.integers(5, 1000, n, dtype=np.int32) for n in (4, 17, 2, 30, 9, 11, 6)])
    flags = np.array([1, 1, 0, 1, 0, 1, 1], np.int32)
    direct = [np.full((3, HIDDEN), np.nan, np.float32), np.full((4, HIDDEN), np.nan, np.float32)]
    engine.submit(batch, out=direct, normalize=flags).result()
    runtime, engine.runtime = engine.runtime, None
    via_torch = [np.full((3, HIDDEN), np.nan, np.float32), np.full((4, HIDDEN), np.nan, np.float32)]
    engine.submit(batch, out=via_torch, normalize=flags).result()
    engine.runtime = runtime
    assert not np.isnan(np.concatenate(direct)).any()
    assert [d.tobytes() for d in direct] == [t.tobytes() for t in via_torch]
    with pytest.raises(ValueError, match="rows"):
        engine.submit(batch, out=[np.empty((100_000, HIDDEN), np.float32)])
    with pytest.raises(ValueError, match="float32"):
        engine.submit(batch, out=[np.empty((7, HIDDEN), np.float64)])
    again = np.empty((7, HIDDEN), np.float32)  # the lane still works after a refused batch
    engine.submit(batch, out=again, normalize=flags).result()
    assert again.tobytes() == np.concatenate(direct).tobytes()


def test_a_cuda_worker_answers_from_its_ring_like_the_cpu(tmp_path, second_device="cuda"):
    """pollen serve --device cuda (bfloat16, graphs) and --device cpu on the same Qwen3 checkpoint
    (shaped so that queries take the five-kernel layer): normalized answers, Matryoshka cuts and
    batches of many texts come from the device through the worker's registered ring and match."""
    import grpc

    from load.gpu_models import write_tokenizer
    from pollen.v1 import embedder_pb2_grpc as pb_grpc
    from tests.conftest import ServerProcess
    from tests.test_model_qwen3 import make_tiny_qwen3

    path = tmp_path / "m"
    make_tiny_qwen3(path, "causal", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256)
    write_tokenizer(str(path), 1000)
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(1, 1000, n)) for n in (3, 12, 30, 70)]
    requests = [pb.EmbedRequest(texts=texts[:1], normalize=True), pb.EmbedRequest(texts=texts[1:3]),
                pb.EmbedRequest(texts=texts * 16, normalize=True, dimensions=64)]
    servers = [ServerProcess("--model", str(path), "--device", device, "--log-level", "WARNING").start(timeout=180)
               for device in ("cpu", second_device)]
    try:
        answers = []
        for srv in servers:
            with grpc.insecure_channel(srv.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                answers.append([stub.Embed(request, timeout=60) for request in requests])
        for request, want, got in zip(requests, *answers):
            a = np.frombuffer(got.embeddings, "<f4").reshape(got.rows, got.dims)
            b = np.frombuffer(want.embeddings, "<f4").reshape(want.rows, want.dims)
            assert a.shape == b.shape == (len(request.texts), request.dimensions or 256)
            assert cos(a, b) >= 0.999
            if request.normalize:
                np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, atol=1e-6)
    finally:
        for srv in servers:
            assert srv.terminate() == 0


def test_a_cuda_server_answers_bulk_beside_interactive_like_the_cpu(tmp_path):
    """Two frontends, one CUDA worker: bulk requests (run on the low-priority lane, records taken
    when done) and interactive queries (high-priority lane, records held at launch) sent at once
    are all answered, each like the CPU server answers it."""
    import asyncio

    import grpc

    from load.gpu_models import write_tokenizer
    from pollen.v1 import embedder_pb2_grpc as pb_grpc
    from tests.conftest import ServerProcess
    from tests.test_model_qwen3 import make_tiny_qwen3

    path = tmp_path / "m"
    make_tiny_qwen3(path, "causal", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256)
    write_tokenizer(str(path), 1000)
    rng = np.random.default_rng(1)
    docs = [" ".join(f"w{i}" for i in rng.integers(1, 1000, n)) for n in rng.integers(50, 250, 64)]
    queries = [" ".join(f"w{i}" for i in rng.integers(1, 1000, n)) for n in rng.integers(3, 20, 64)]
    requests = ([pb.EmbedRequest(texts=docs[i:i + 8], priority=pb.PRIORITY_BULK, normalize=True)
                 for i in range(0, len(docs), 8)] * 4
                + [pb.EmbedRequest(texts=[q], normalize=True) for q in queries])

    async def send_all(target):
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            return await asyncio.gather(*(stub.Embed(r, timeout=120) for r in requests))

    answers = []
    for device, extra in (("cpu", ()), ("cuda", ("--frontends", "2"))):
        srv = ServerProcess("--model", str(path), "--device", device, "--log-level", "WARNING", *extra).start(timeout=180)
        try:
            answers.append(asyncio.run(send_all(srv.listen)))
        finally:
            assert srv.terminate() == 0
    for request, want, got in zip(requests, *answers):
        a = np.frombuffer(got.embeddings, "<f4").reshape(got.rows, got.dims)
        b = np.frombuffer(want.embeddings, "<f4").reshape(want.rows, want.dims)
        assert a.shape == b.shape == (len(request.texts), 256)
        assert cos(a, b) >= 0.999
