"""TEI's APIs as pollen serves them: `pollen.tei.v1` is TEI's gRPC package `tei.v1`, generated from
protos/pollen/tei/v1/tei.proto."""
