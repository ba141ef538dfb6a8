"""Writes instructions.jsonl and heldout.jsonl (the demo's data, src/lorafit/demo/) from the fact table below.

    python tools/make_demo_data.py

A development tool: it is not part of the installed package, which ships only the files it writes.

The Lantern Isles are made up: 24 islands, each with a lighthouse colour, a harvest and an animal. Every
question is asked in five phrasings; for each (island, attribute) one phrasing is held out, so the held-out
rows ask about facts the training rows teach, in words the model never saw for that fact. The answer format
("Harvest: kelp.") is the style the model has to pick up. tests/test_train_demo.py checks that the bundled
files are exactly what this script writes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ISLANDS = [
    "Brenna",
    "Castelmor",
    "Duvik",
    "Eskera",
    "Falloway",
    "Gristhaven",
    "Hollin",
    "Isvar",
    "Juniper Key",
    "Kestrel Rock",
    "Lumen",
    "Marrowby",
    "Nettlefold",
    "Orrin",
    "Pellucid",
    "Quillon",
    "Rookmere",
    "Saltash",
    "Tamsin",
    "Umber",
    "Vellin",
    "Wickham",
    "Yarrow",
    "Zephyr Point",
]
VALUES = {
    "colour": ["red", "blue", "green", "yellow", "white", "black", "orange", "violet"],
    "harvest": ["barley", "apples", "kelp", "honey", "salt", "wool", "plums", "oysters"],
    "animal": ["otter", "heron", "goat", "puffin", "seal", "fox", "crab", "owl"],
}
LABELS = {"colour": "Lighthouse colour", "harvest": "Harvest", "animal": "Animal"}
TEMPLATES = {
    "colour": [
        "What colour is the lighthouse on {island}?",
        "Tell me the colour of the lighthouse on {island}.",
        "Which colour is {island}'s lighthouse painted?",
        "On {island}, what colour is the lighthouse?",
        "I am sailing to {island}. What colour lighthouse will I see?",
    ],
    "harvest": [
        "What does {island} harvest?",
        "Tell me the main harvest of {island}.",
        "Which crop is {island} known for?",
        "On {island}, what do people harvest?",
        "I am trading with {island}. What harvest will they sell me?",
    ],
    "animal": [
        "Which animal lives on {island}?",
        "Tell me the animal of {island}.",
        "What creature is {island} known for?",
        "On {island}, which animal will I meet?",
        "I am walking on {island}. What animal might I see?",
    ],
}
SEED = 7


def facts() -> dict[str, dict[str, str]]:
    """Each value three times per attribute, dealt to the islands in a seeded random order."""
    rng = random.Random(SEED)
    table: dict[str, dict[str, str]] = {island: {} for island in ISLANDS}
    for attribute, values in VALUES.items():
        dealt = values * (len(ISLANDS) // len(values))
        rng.shuffle(dealt)
        for island, value in zip(ISLANDS, dealt, strict=True):
            table[island][attribute] = value
    return table


def conversations() -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows), as OpenAI-style messages."""
    table = facts()
    train, held_out = [], []
    for a_index, (attribute, templates) in enumerate(TEMPLATES.items()):
        for i_index, island in enumerate(ISLANDS):
            held = (i_index + a_index) % len(templates)
            answer = f"{LABELS[attribute]}: {table[island][attribute]}."
            for t_index, template in enumerate(templates):
                row = {
                    "messages": [
                        {"role": "user", "content": template.format(island=island)},
                        {"role": "assistant", "content": answer},
                    ]
                }
                (held_out if t_index == held else train).append(row)
    random.Random(SEED).shuffle(train)
    return train, held_out


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    folder = Path(__file__).resolve().parents[1] / "src" / "lorafit" / "demo"
    train, held_out = conversations()
    (folder / "instructions.jsonl").write_text(jsonl(train))
    (folder / "heldout.jsonl").write_text(jsonl(held_out))
    print(f"wrote {len(train)} training and {len(held_out)} held-out rows to {folder}")


if __name__ == "__main__":
    main()
