"""Test inputs: varied texts made deterministically, and the STS Benchmark pairs shipped in tests/data/stsb."""
from __future__ import annotations

import csv
import pathlib
import random

REPO = pathlib.Path(__file__).resolve().parents[1]
# The STS Benchmark test split (CC BY-SA 4.0: LICENSE beside it), shipped with the tests.
STSB = REPO / "tests" / "data" / "stsb" / "stsb-en-test.csv"

_PARAGRAPH = (
    "Embedding servers turn text into vectors that search systems compare by cosine similarity. "
    "A long document must be cut to the model's context, and where it is cut matters: the start "
    "of a page usually says what the page is about, while its end often holds references. "
)

_SEEDS = [
    "hello", "a", "?", "42", "Z", "ok", "ñ", "東", "🙂", "x y",
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu: naïve coöperation, façade, jalapeño, Ångström.",
    "Москва — столица России, а Київ — столиця України.",
    "Ελληνικά γράμματα: αλφα, βήτα, γάμμα.",
    "مرحبا بالعالم، هذا نص عربي قصير.",
    "שלום עולם, זה טקסט בעברית.",
    "हिन्दी में एक छोटा वाक्य।",
    "東京は日本の首都です。今日は晴れています。",
    "北京是中国的首都，人口超过两千万。",
    "서울은 대한민국의 수도입니다.",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Emoji party 🎉🎉🎉 with pizza 🍕, rockets 🚀 and flags 🇫🇷🇯🇵.",
    "👨‍👩‍👧‍👦 family emoji (ZWJ sequence) and skin tones 👋🏽👋🏿",
    "def add(a, b):\n    return a + b  # Python code",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    "{\"json\": [1, 2, 3], \"nested\": {\"ok\": true}}",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\nmixed",
    "ALL CAPS SHOUTING TEXT!!!",
    "https://example.com/path?query=1&other=two#fragment",
    "e-mail: someone@example.org, phone +1 (555) 010-9999",
    "Numbers: 3.14159, 2.71828, 1e-9, -0.0, 1,000,000.",
    "Mathematical ∑ ∫ √ ∞ ≠ ≤ ≥ symbols and Greek π",
    "Zero\u200bwidth\u200bspaces and soft\u00adhyphens",
    "ｆｕｌｌｗｉｄｔｈ　ｌｅｔｔｅｒｓ",
    "a" * 300,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
]


def varied_texts(n: int = 200, seed: int = 7) -> list[str]:
    """n varied texts: short, unicode, emoji, CJK, code, and texts far over 512 tokens."""
    rng = random.Random(seed)
    texts = list(_SEEDS)
    texts += [_PARAGRAPH * k for k in (12, 20, 30)]  # ~600 to ~1,600 tokens
    texts.append(" ".join(rng.choice(_SEEDS[10:25]) for _ in range(60)))  # mixed scripts, long
    sentences = [a for a, _, _ in stsb_pairs()]
    while len(texts) < n:
        kind = rng.random()
        if kind < 0.5:
            texts.append(rng.choice(sentences))
        elif kind < 0.8:
            texts.append(" ".join(rng.sample(sentences, rng.randint(2, 6))))
        else:
            a, b = rng.sample(_SEEDS, 2)
            texts.append(f"{a} {b}")
    return texts[:n]


def stsb_pairs(path: str | None = None) -> list[tuple[str, str, float]]:
    """The STS-B test pairs (sentence, sentence, gold score) from `path`, else the shipped file."""
    with open(pathlib.Path(path or STSB), newline="", encoding="utf-8") as f:
        return [(a, b, float(s)) for a, b, s in csv.reader(f)]

