"""Tile configurations of worker/kernels/skinny.py, tuned by worker/kernels/tune_skinny.py on the
GPU docs/performance.md names.

Keys: "kind,K,N,BLOCK_M" -> (BLOCK_N, BLOCK_K, num_warps, num_stages, split K); "layer,hidden,0,BLOCK_M" ->
[1] where the five-kernel layer beat the eight separate kernels, [0] where it lost (then that
model runs those batches on the general path). Other GPUs take the same table: re-measure there.
"""

MEASURED = {
    "norm,1024,4096,16": (32, 256, 4, 4, 1),
    "residual,2048,1024,16": (32, 128, 4, 4, 4),
    "swiglu,1024,3072,16": (32, 128, 4, 4, 1),
    "residual,3072,1024,16": (32, 128, 4, 4, 8),
    "layer,1024,0,16": [1],
    "norm,1024,4096,32": (32, 128, 4, 4, 1),
    "residual,2048,1024,32": (32, 128, 4, 4, 4),
    "swiglu,1024,3072,32": (32, 128, 4, 4, 1),
    "residual,3072,1024,32": (32, 128, 4, 4, 4),
    "layer,1024,0,32": [1],
    "norm,1024,4096,64": (32, 128, 4, 4, 1),
    "residual,2048,1024,64": (32, 128, 4, 4, 4),
    "swiglu,1024,3072,64": (32, 128, 4, 4, 1),
    "residual,3072,1024,64": (32, 128, 4, 4, 4),
    "layer,1024,0,64": [1],
    "norm,2560,6144,16": (32, 256, 4, 4, 1),
    "residual,4096,2560,16": (32, 128, 4, 4, 4),
    "swiglu,2560,9728,16": (32, 128, 4, 3, 1),
    "residual,9728,2560,16": (32, 128, 4, 4, 4),
    "layer,2560,0,16": [1],
    "norm,2560,6144,32": (32, 256, 4, 3, 1),
    "residual,4096,2560,32": (32, 128, 4, 4, 4),
    "swiglu,2560,9728,32": (64, 128, 4, 3, 1),
    "residual,9728,2560,32": (32, 128, 4, 4, 4),
    "layer,2560,0,32": [1],
    "norm,2560,6144,64": (32, 128, 4, 4, 1),
    "residual,4096,2560,64": (32, 256, 4, 4, 1),
    "swiglu,2560,9728,64": (32, 128, 4, 3, 1),
    "residual,9728,2560,64": (32, 256, 4, 4, 1),
    "layer,2560,0,64": [0],
}
