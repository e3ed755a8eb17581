from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_FLOAT32: _ClassVar[Encoding]
    ENCODING_FLOAT16: _ClassVar[Encoding]
    ENCODING_BFLOAT16: _ClassVar[Encoding]
    ENCODING_INT8: _ClassVar[Encoding]
    ENCODING_UBINARY: _ClassVar[Encoding]

class Truncate(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATE_NONE: _ClassVar[Truncate]
    TRUNCATE_END: _ClassVar[Truncate]
    TRUNCATE_START: _ClassVar[Truncate]

class LongInput(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LONG_INPUT_TRUNCATE: _ClassVar[LongInput]
    LONG_INPUT_CHUNK_MEAN: _ClassVar[LongInput]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BULK: _ClassVar[Priority]

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_UNSPECIFIED: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]
    POOLING_CLS: _ClassVar[Pooling]
    POOLING_LAST: _ClassVar[Pooling]

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_UNSPECIFIED: _ClassVar[Output]
    OUTPUT_DENSE: _ClassVar[Output]
    OUTPUT_SPARSE: _ClassVar[Output]
    OUTPUT_TOKENS: _ClassVar[Output]
ENCODING_FLOAT32: Encoding
ENCODING_FLOAT16: Encoding
ENCODING_BFLOAT16: Encoding
ENCODING_INT8: Encoding
ENCODING_UBINARY: Encoding
TRUNCATE_NONE: Truncate
TRUNCATE_END: Truncate
TRUNCATE_START: Truncate
LONG_INPUT_TRUNCATE: LongInput
LONG_INPUT_CHUNK_MEAN: LongInput
PRIORITY_INTERACTIVE: Priority
PRIORITY_BULK: Priority
POOLING_UNSPECIFIED: Pooling
POOLING_MEAN: Pooling
POOLING_CLS: Pooling
POOLING_LAST: Pooling
OUTPUT_UNSPECIFIED: Output
OUTPUT_DENSE: Output
OUTPUT_SPARSE: Output
OUTPUT_TOKENS: Output

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("id", "texts", "token_ids", "dimensions", "normalize", "encoding", "truncate", "max_tokens", "prompt_name", "prompt", "long_input", "chunks", "priority", "timeout_ms", "model", "outputs", "sparse_top_k", "sparse_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LONG_INPUT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    SPARSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    dimensions: int
    normalize: bool
    encoding: Encoding
    truncate: Truncate
    max_tokens: int
    prompt_name: str
    prompt: str
    long_input: LongInput
    chunks: _containers.RepeatedScalarFieldContainer[str]
    priority: Priority
    timeout_ms: int
    model: str
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    sparse_top_k: int
    sparse_tokens: bool
    def __init__(self, id: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., max_tokens: _Optional[int] = ..., prompt_name: _Optional[str] = ..., prompt: _Optional[str] = ..., long_input: _Optional[_Union[LongInput, str]] = ..., chunks: _Optional[_Iterable[str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., timeout_ms: _Optional[int] = ..., model: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ..., sparse_top_k: _Optional[int] = ..., sparse_tokens: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens",)
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_us", "inference_us", "tokenize_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    inference_us: int
    tokenize_us: int
    def __init__(self, queue_us: _Optional[int] = ..., inference_us: _Optional[int] = ..., tokenize_us: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("id", "embeddings", "rows", "dims", "encoding", "usage", "timing", "error", "scales", "model", "token_embeddings", "token_counts", "sparse_indices", "sparse_values", "sparse_counts", "sparse_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_INDICES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_VALUES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    embeddings: bytes
    rows: int
    dims: int
    encoding: Encoding
    usage: Usage
    timing: Timing
    error: Error
    scales: _containers.RepeatedScalarFieldContainer[float]
    model: str
    token_embeddings: bytes
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    sparse_indices: bytes
    sparse_values: bytes
    sparse_counts: _containers.RepeatedScalarFieldContainer[int]
    sparse_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., embeddings: _Optional[bytes] = ..., rows: _Optional[int] = ..., dims: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., scales: _Optional[_Iterable[float]] = ..., model: _Optional[str] = ..., token_embeddings: _Optional[bytes] = ..., token_counts: _Optional[_Iterable[int]] = ..., sparse_indices: _Optional[bytes] = ..., sparse_values: _Optional[bytes] = ..., sparse_counts: _Optional[_Iterable[int]] = ..., sparse_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "truncate", "max_tokens", "prompt_name", "prompt", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    truncate: Truncate
    max_tokens: int
    prompt_name: str
    prompt: str
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., max_tokens: _Optional[int] = ..., prompt_name: _Optional[str] = ..., prompt: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "counts", "usage")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenIds]
    counts: _containers.RepeatedScalarFieldContainer[int]
    usage: Usage
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., counts: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "task", "dimensions", "max_tokens", "pooling", "vocab_size", "prompts", "matryoshka_dimensions", "labels", "sparse", "quantization")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    task: str
    dimensions: int
    max_tokens: int
    pooling: Pooling
    vocab_size: int
    prompts: _containers.ScalarMap[str, str]
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    sparse: bool
    quantization: str
    def __init__(self, name: _Optional[str] = ..., task: _Optional[str] = ..., dimensions: _Optional[int] = ..., max_tokens: _Optional[int] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., vocab_size: _Optional[int] = ..., prompts: _Optional[_Mapping[str, str]] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., sparse: _Optional[bool] = ..., quantization: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "dimensions", "max_tokens", "pooling", "encodings", "max_texts_per_request", "max_batch_tokens", "max_queued_tokens", "max_request_bytes", "vocab_size", "workers", "device", "prompts", "matryoshka_dimensions", "frontends", "frontend", "task", "labels", "models")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXTS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dimensions: int
    max_tokens: int
    pooling: Pooling
    encodings: _containers.RepeatedScalarFieldContainer[Encoding]
    max_texts_per_request: int
    max_batch_tokens: int
    max_queued_tokens: int
    max_request_bytes: int
    vocab_size: int
    workers: int
    device: str
    prompts: _containers.ScalarMap[str, str]
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    frontends: int
    frontend: int
    task: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, model: _Optional[str] = ..., dimensions: _Optional[int] = ..., max_tokens: _Optional[int] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., encodings: _Optional[_Iterable[_Union[Encoding, str]]] = ..., max_texts_per_request: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_queued_tokens: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ..., workers: _Optional[int] = ..., device: _Optional[str] = ..., prompts: _Optional[_Mapping[str, str]] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., frontends: _Optional[int] = ..., frontend: _Optional[int] = ..., task: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("id", "query", "documents", "top_n", "return_documents", "instruction", "raw_scores", "truncate", "max_tokens", "priority", "timeout_ms", "model", "max_document_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_DOCUMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    instruction: str
    raw_scores: bool
    truncate: Truncate
    max_tokens: int
    priority: Priority
    timeout_ms: int
    model: str
    max_document_tokens: int
    def __init__(self, id: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., instruction: _Optional[str] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., timeout_ms: _Optional[int] = ..., model: _Optional[str] = ..., max_document_tokens: _Optional[int] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("id", "results", "usage", "timing", "model", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    timing: Timing
    model: str
    error: Error
    def __init__(self, id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., model: _Optional[str] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("id", "texts", "text_pairs", "raw_scores", "truncate", "max_tokens", "priority", "timeout_ms", "model")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TEXT_PAIRS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    id: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    text_pairs: _containers.RepeatedScalarFieldContainer[str]
    raw_scores: bool
    truncate: Truncate
    max_tokens: int
    priority: Priority
    timeout_ms: int
    model: str
    def __init__(self, id: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., text_pairs: _Optional[_Iterable[str]] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., timeout_ms: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class ClassifyResult(_message.Message):
    __slots__ = ("index", "labels")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    index: int
    labels: _containers.RepeatedCompositeFieldContainer[LabelScore]
    def __init__(self, index: _Optional[int] = ..., labels: _Optional[_Iterable[_Union[LabelScore, _Mapping]]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("id", "results", "usage", "timing", "model")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    id: str
    results: _containers.RepeatedCompositeFieldContainer[ClassifyResult]
    usage: Usage
    timing: Timing
    model: str
    def __init__(self, id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ClassifyResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...
