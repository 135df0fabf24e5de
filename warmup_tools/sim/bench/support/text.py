"""Seeded synthetic prompt text of a target token length, for benchmarks and traffic."""

from __future__ import annotations

import random

WORDS = (
    "account invoice refund policy customer order shipping status region revenue quarter contract clause "
    "liability indemnity termination notice party supplier warranty payment schedule delivery service "
    "table column query join filter group total average monthly weekly report dashboard metric latency "
    "cache prefix token model adapter tenant request response server cluster replica memory budget "
    "question answer summary detail step reason example template context document section paragraph"
).split()


def make_text(tokenizer: object, n_tokens: int, rng: random.Random) -> str:
    """Random words until the text tokenises to at least ``n_tokens`` tokens, then cut back to about it."""
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(max(1, (n_tokens - _count(tokenizer, words)) // 2)))
        if _count(tokenizer, words) >= n_tokens:
            break
    while len(words) > 1 and _count(tokenizer, words[:-1]) >= n_tokens:
        words.pop()
    return " ".join(words)


def _count(tokenizer: object, words: list[str]) -> int:
    return len(tokenizer.encode(" ".join(words), add_special_tokens=False)) if words else 0
