"""The frontend processes and their supervisor: the doors clients call, and everything between a
request and the worker's rings.

    process/    start-up and the processes: `pollen serve` (app), the supervisor, a frontend's wiring
    grpc_api/   the gRPC door: pollen.v1.Embedder and TEI's tei.v1, translated for the core
    http_api/   the HTTP door: OpenAI, Cohere/Jina and TEI routes, translated for the core
    core.py     what every door asks: embed, rerank, classify, tokenize; counted, traced, drained
    model_table.py  the served models by name, and which one a request gets
    pipeline/   a request's way to a worker and back: admission, tokenizers, router, channels
    tasks/      what a task adds to that way: rerank pairs, classify, sparse and token vectors
    observe/    metrics and tracing
    config.py   every flag of `pollen serve` (ServeConfig), auth.py the API keys, tei.py TEI's tokens

Each layer imports only those below it (tests/test_import_cycles.py checks it): observe, config,
auth and tei import nothing of server/; the pipeline imports observe and config; the tasks the
pipeline; the core the pipeline, the tasks and the model table; a door the core and the model
table, never the pipeline, the tasks or another door; process wires them all.
"""
