"""The gRPC door: pollen.v1.Embedder (service.py) and TEI's tei.v1 (tei.py) on grpc.aio, each method
translated for the core (server/core.py) and its answer or refusal back into gRPC's terms;
lenient deserializers, the API keys, the drain's hold and the flood guard (flood_guard.py) around
every method. May import the core, the model table, observe, config, auth and tei; never the
pipeline, the tasks or the HTTP door.
"""
