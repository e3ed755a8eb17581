"""Texts to token ids with the model's own tokenizer.json, truncation as the request asks.

The HF `tokenizers` library releases the GIL while it encodes, so the frontend runs `encode` on a
thread pool and the event loop stays free.
"""
from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from pollen.v1 import embedder_pb2 as pb
from server.errors import invalid


class TextTokenizer:
    def __init__(self, model_dir: str, max_tokens: int):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model_dir}: no tokenizer.json (pollen needs the fast-tokenizer file)")
        self.tokenizer = Tokenizer.from_file(path)
        # The file may carry padding and truncation settings of its own; we apply ours.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.max_tokens = max_tokens
        self.special = self.tokenizer.num_special_tokens_to_add(False)

    def encode(self, texts: list[str], truncate: int) -> list[np.ndarray]:
        """Token ids (special tokens included) for each text, each at most max_tokens long."""
        for i, text in enumerate(texts):
            if not text:
                raise invalid(f"texts[{i}] is empty: every text needs at least one character")
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        room = self.max_tokens - self.special
        out = []
        for i, enc in enumerate(encodings):
            if len(enc.ids) > room:
                if truncate == pb.TRUNCATE_NONE:
                    raise invalid(
                        f"texts[{i}] has {len(enc.ids) + self.special} tokens, over the model's limit of "
                        f"{self.max_tokens}; shorten it or set truncate to TRUNCATE_END or TRUNCATE_START")
                enc.truncate(room, direction="right" if truncate == pb.TRUNCATE_END else "left")
            out.append(np.asarray(self.tokenizer.post_process(enc).ids, dtype=np.int32))
        return out


