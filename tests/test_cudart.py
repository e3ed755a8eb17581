"""worker/cudart.py on the CPU machine: it finds the CUDA runtime this process has mapped, and
nothing where none is (the engine then keeps torch's copy_). Its copies are tested on the GPU
(tests/test_cuda_ring.py, test_direct_copies_equal_torch_copies_and_never_overrun)."""
from pollen.worker import cudart


def test_the_runtime_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 2 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13\n")
    assert cudart.loaded_runtime_path(str(maps)) == "/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert cudart.loaded_runtime_path(str(maps)) is None
    assert cudart.loaded_runtime_path(str(tmp_path / "missing")) is None


def test_no_runtime_mapped_means_none():
    # A CPU torch maps no libcudart: find() says so rather than loading one of its own.
    assert (cudart.find() is None) == (cudart.loaded_runtime_path() is None)
