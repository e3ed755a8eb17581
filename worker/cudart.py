"""cudaMemcpyAsync straight from the CUDA runtime torch loaded, for the engine's small per-batch copies.

A lone query's batch makes two copies on its critical path: its inputs up (a few hundred bytes)
and its rows down into the response ring. The runtime's own call through ctypes costs less host
time than `Tensor.copy_` (torch's dispatch, the caching host allocator's bookkeeping, a tensor
made around the numpy record).

Only memory that stays valid for the copy without torch's bookkeeping goes through here: a
lane's static inputs and pinned slots (alive as long as the engine), a graph's output rows, an
eager forward's rows (freed to torch's allocator for the same stream, so any reuse is queued
behind the copy), and response-ring records (registered with cudaHostRegister, so the copy is a
true DMA). The caller orders the copy on its stream and records the events it waits on, as with
`copy_`.

`find()` opens the libcudart that this process has already mapped (torch's own), so the stream
handles are that runtime's; None where there is none to find (a torch that links the runtime
statically, or no CUDA), and the engine keeps `copy_`.
"""
from __future__ import annotations

import ctypes

HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2


class CudaRuntime:
    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """Queue a copy of nbytes from address src to dst on stream (a cudaStream_t as int)."""
        err = self._memcpy(dst, src, nbytes, kind, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes (kind {kind}) failed with cudaError {err}")


def loaded_runtime_path(maps: str = "/proc/self/maps") -> str | None:
    """The file of the libcudart mapped into this process, if any."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def find() -> CudaRuntime | None:
    """The runtime torch loaded (call after torch has initialized CUDA), or None."""
    path = loaded_runtime_path()
    if path is None:
        return None
    try:
        return CudaRuntime(path)
    except (OSError, AttributeError):
        return None
