"""The HTTP door: HTTP/1.1 on h11 (http11.py), OpenAI's /v1/embeddings, /v1/models, /health and
/metrics (door.py), Cohere's and Jina's rerank (rerank.py), /v1/classify (classify.py) and TEI's
routes (tei.py), each body translated for the core (server/core.py). May import the core, the
model table, observe, config, auth and tei; never the pipeline, the tasks or the gRPC door.
"""
