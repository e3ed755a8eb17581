"""Load-test texts made here, deterministically (fixed seed), so the locustfile needs nothing
outside the repository: short search queries and passage-sized documents, in a few scripts."""
from __future__ import annotations

import random

_WORDS = """
search engine vector index query ranking relevance cosine similarity document passage paragraph
sentence token model embedding server latency throughput batch queue worker stream memory cache
river mountain city harbour train bicycle weather morning evening winter summer garden kitchen
coffee bread market music library museum hospital school teacher student doctor engineer farmer
quick slow bright quiet heavy light ancient modern simple complex careful sudden gentle strong
build read write measure compare explain travel remember discover repair improve choose follow
because although while after before during between under above across through without within
""".split()
_FOREIGN = ["東京の天気", "北京大学", "서울 지하철", "Москва река", "Ελληνικά", "café déjà vu", "naïve façade",
            "مرحبا", "שלום", "हिन्दी", "ภาษาไทย", "🙂", "🚀"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(_FOREIGN))
    return " ".join(words).capitalize() + "."


def queries(n: int = 500, seed: int = 1) -> list[str]:
    """Search-box queries: 2 to 8 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8))) for _ in range(n)]


def documents(n: int = 300, seed: int = 2) -> list[str]:
    """Passages of 3 to 12 sentences (roughly 40 to 250 tokens), under the model's 256-token limit."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(3, 12))) for _ in range(n)]
