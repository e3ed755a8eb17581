"""pollen: a text-embedding server.

The parts, each a folder of the repository: `pollen.v1` (the generated gRPC API, from protos/),
`pollen.tei.v1` (TEI's gRPC API, served beside it), `pollen.server` (the frontend),
`pollen.shared_mem` (the rings), `pollen.worker` (the engine process), `pollen.common` (what
frontend and worker share) and `pollen.client` (the Python client).
"""
