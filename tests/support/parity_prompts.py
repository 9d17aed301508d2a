"""The prompts the parity tests decode greedily, against the HF reference (``tests/engine``) and across
compute paths (``tests/kernels``): chat and raw text in several scripts, token ids, a long prompt."""

from __future__ import annotations

from typing import Any

_CITIES = ["Lisbon", "Oslo", "Kyoto", "Nairobi", "Lima", "Quebec", "Tbilisi"]
_THINGS = ["old harbour", "night markets", "mountain trails", "wooden temples", "street music"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_DETAILS = [
    "the bakeries open before dawn",
    "the trains are always on time",
    "the museums are free on Sundays",
    "the river freezes for a few weeks",
    "the festival lasts nine days",
    "the library keeps maps from the 1600s",
]
LONG_NOTES = "\n".join(
    f"Note {i + 1}: {_CITIES[i % 7]} is loved for its {_THINGS[i % 5]}; visitors say that in "
    f"{_SEASONS[i % 4]} {_DETAILS[i % 6]}."
    for i in range(30)
)

# (name, kind, payload): kind "chat" (user text, optional system), "raw" (text) or "ids".
PROMPTS: list[tuple[str, str, Any]] = [
    ("chat-capital", "chat", ("What is the capital of France?", None)),
    ("chat-haiku-system", "chat", ("Write a haiku about the sea.", "You are a poet.")),
    ("chat-chinese", "chat", ("用中文写一句关于春天的话。", None)),
    (
        "chat-long-notes",
        "chat",
        ("Read these travel notes and say which city has the longest festival.\n\n" + LONG_NOTES, None),
    ),
    ("raw-fox", "raw", "The quick brown fox"),
    ("raw-code", "raw", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("raw-french", "raw", "Les élèves étudient à l'école parce que"),
    ("raw-emoji", "raw", "My favourite emojis are 😀, 🎉 and"),
    ("raw-japanese", "raw", "日本の首都は"),
    # Token ids given directly ("The capital of France is"); greedy ends with EOS at token 30,
    # so ignore_eos also carries the comparison past an EOS.
    ("ids-capital", "ids", [504, 3575, 282, 4649, 314]),
]
