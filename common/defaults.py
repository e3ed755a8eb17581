"""The automatic values of the settings `pollen serve`, `pollen bulk` (bulk/embedder.py) and an
engine made in code share, in one place: for the same machine and model each gets the same value.

--max-batch-tokens auto, where the model's limit is lower. A GPU fills its SMs with large
batches. A CPU worker cuts a batch at sequence bounds into one piece per thread
(worker/cpu_engine.py): a batch of few sequences leaves threads idle or some pieces a sequence
longer than others, so it gets CPU_TOKENS_PER_THREAD tokens per worker thread, several sequences
of a few hundred tokens (rerank pairs, passages) in each piece. One thread's tokens/s is flat
from a few hundred tokens a batch on, while the working set, which the worker's heap keeps
(server/config.py WORKER_HEAP_KEEP), and the time a batch holds the worker grow with the batch:
no more than that. A bulk batch is what an interactive query that arrives behind it waits for
(docs/performance.md, Levers tried), so --bulk-batch-tokens auto on the CPU is half that a thread,
and never below CPU_BULK_TOKENS_MIN; on CUDA bulk batches replay graphs too (an eager one would
hold the worker's thread for the milliseconds of its kernel launches, in front of any
interactive request), so they are at most the largest graph's tokens.
"""
from __future__ import annotations

CUDA_BATCH_TOKENS = 8192
CPU_TOKENS_PER_THREAD = 1024
CPU_BULK_TOKENS_PER_THREAD = 512
CPU_BULK_TOKENS_MIN = 1024


def dtype(device: str) -> str:
    """--dtype auto: bfloat16 on a GPU, float32 on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def batch_tokens(device: str, threads: int, model_max_tokens: int) -> int:
    """--max-batch-tokens auto for the device, the worker's threads and the model's limit."""
    per_device = CUDA_BATCH_TOKENS if device.startswith("cuda") else CPU_TOKENS_PER_THREAD * max(1, threads)
    return max(per_device, model_max_tokens)


def bulk_batch_tokens(device: str, threads: int, max_batch_tokens: int, graph_max_tokens: int) -> int:
    """--bulk-batch-tokens auto, once --max-batch-tokens is set."""
    if device.startswith("cuda"):
        return min(max_batch_tokens, graph_max_tokens or max_batch_tokens)
    return min(max_batch_tokens, max(CPU_BULK_TOKENS_MIN, CPU_BULK_TOKENS_PER_THREAD * max(1, threads)))
