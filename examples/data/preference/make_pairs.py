"""Write the preference example data: DPO pairs and KTO samples teaching one visible habit.

The chosen answer starts with "Sure!", answers the everyday question in a short friendly
sentence and signs off with "Hope that helps!"; the rejected answer is curt (the bare
answer) or unhelpful. A model trained on the pairs should start its answers with "Sure!"
and end them with the sign-off, which anyone can see in a chat.

Deterministic, no external data. Run from anywhere:
    python examples/data/preference/make_pairs.py
writes train.jsonl (96 pairs), heldout.jsonl (16 pairs, other questions) and kto.jsonl
(40 samples, half desirable) next to this file, in TRL's conversational formats.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIGN_OFF = "Hope that helps!"
UNHELPFUL = [
    "Look it up.",
    "Why do you ask?",
    "Not my problem.",
    "No idea.",
    "Figure it out yourself.",
    "Ask someone else.",
    "Whatever.",
    "I don't feel like answering.",
]

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Spain", "Madrid"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
]
COLORS = [
    ("a ripe banana", "yellow"),
    ("grass", "green"),
    ("a clear daytime sky", "blue"),
    ("fresh snow", "white"),
    ("a ripe tomato", "red"),
    ("coal", "black"),
    ("a carrot", "orange"),
    ("a lemon", "yellow"),
]
OPPOSITES = [
    ("hot", "cold"),
    ("up", "down"),
    ("early", "late"),
    ("full", "empty"),
    ("open", "closed"),
    ("loud", "quiet"),
    ("heavy", "light"),
    ("fast", "slow"),
    ("wet", "dry"),
    ("young", "old"),
]
BABY_ANIMALS = [
    ("cat", "a kitten"),
    ("dog", "a puppy"),
    ("cow", "a calf"),
    ("sheep", "a lamb"),
    ("horse", "a foal"),
    ("frog", "a tadpole"),
    ("duck", "a duckling"),
    ("goat", "a kid"),
]
PLURALS = [
    ("mouse", "mice"),
    ("child", "children"),
    ("tooth", "teeth"),
    ("goose", "geese"),
    ("person", "people"),
    ("leaf", "leaves"),
    ("knife", "knives"),
    ("foot", "feet"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIPS = [
    ("How can I fall asleep faster?", "Keep a regular bedtime and put your phone away early."),
    ("How do I keep basil alive?", "Give it lots of sun and water when the soil feels dry."),
    ("How do I stop my glasses fogging up?", "A drop of dish soap rubbed on the lenses helps."),
    ("How do I remember a new name?", "Say it back once when you meet, then use it again soon."),
    ("How can I make rice less sticky?", "Rinse it in cold water until the water runs clear."),
    ("How do I get rid of a hiccup?", "Sip cold water slowly or hold your breath briefly."),
    (
        "How do I keep bread fresh longer?",
        "Store it in a paper bag, or freeze slices you won't eat.",
    ),
    ("How do I clean a stained mug?", "Scrub it with a paste of baking soda and a little water."),
    ("How can I save on my power bill?", "Switch off lights and unplug chargers you aren't using."),
    ("How do I untangle a necklace?", "Lay it flat and loosen the knot with two pins."),
]

MORE_TIPS = [
    ("How do I stop a squeaky door?", "Put a few drops of oil on the hinges and swing it."),
    ("How do I soften hard butter?", "Grate it, or leave it near a warm spot for a bit."),
    ("How can I wake up easier?", "Open the curtains as soon as your alarm rings."),
    ("How do I keep cut apples from browning?", "Squeeze a little lemon juice over them."),
    ("How do I dry wet shoes?", "Stuff them with newspaper and leave them somewhere airy."),
    ("How do I get gum off my shoe?", "Freeze it with an ice cube, then scrape it away."),
]
LEGS = [("spider", 8), ("ant", 6), ("cat", 4), ("chicken", 2), ("beetle", 6)]
MISC = [
    ("Which planet is closest to the Sun?", "Mercury is the closest.", "Mercury"),
    ("How many days are in a leap year?", "A leap year has 366 days.", "366"),
    ("What do bees make?", "Bees make honey.", "Honey"),
    ("What is frozen water called?", "It is called ice.", "Ice"),
    ("How many sides does a triangle have?", "A triangle has three sides.", "Three"),
    ("Which season comes after winter?", "Spring comes after winter.", "Spring"),
    ("What gas do plants take in?", "Plants take in carbon dioxide.", "Carbon dioxide"),
    ("How many months are in a year?", "There are twelve months.", "Twelve"),
    ("What is the largest ocean?", "The Pacific is the largest.", "Pacific"),
    ("What do caterpillars turn into?", "They turn into butterflies or moths.", "Butterflies"),
]


def facts() -> list[tuple[str, str, str]]:
    """(question, friendly answer, bare answer) for every question, each one different."""
    out = []
    for country, city in CAPITALS:
        out.append((f"What is the capital of {country}?", f"The capital is {city}.", city))
    for thing, color in COLORS:
        out.append((f"What color is {thing}?", f"It is {color}.", color.capitalize()))
    for word, opposite in OPPOSITES:
        out.append((f"What is the opposite of {word}?", f"The opposite is {opposite}.", opposite))
    for animal, baby in BABY_ANIMALS:
        out.append((f"What is a baby {animal} called?", f"It is called {baby}.", baby))
    for word, plural in PLURALS:
        out.append((f"What is the plural of {word}?", f"It is {plural}.", plural))
    for i, day in enumerate(DAYS):
        after = DAYS[(i + 1) % 7]
        out.append((f"What day comes after {day}?", f"{after} comes next.", after))
    for hours in range(1, 9):
        minutes = hours * 60
        q = f"How many minutes are in {hours} hour{'s' if hours > 1 else ''}?"
        out.append((q, f"There are {minutes} minutes.", str(minutes)))
    for a, b in [(2, 3), (7, 5), (12, 9), (15, 15), (21, 4), (30, 12), (8, 8), (40, 2)]:
        out.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", str(a + b)))
    for a, b in [(3, 4), (6, 7), (9, 9), (5, 12), (11, 3), (8, 6)]:
        out.append((f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", str(a * b)))
    for days, weeks in [(14, 2), (21, 3), (28, 4), (35, 5), (42, 6), (49, 7)]:
        out.append((f"How many weeks are in {days} days?", f"That is {weeks} weeks.", str(weeks)))
    for animal, legs in LEGS:
        out.append((f"How many legs does a {animal} have?", f"It has {legs} legs.", str(legs)))
    for minutes in (2, 3, 5, 10, 15):
        q = f"How many seconds are in {minutes} minutes?"
        out.append((q, f"There are {minutes * 60} seconds.", str(minutes * 60)))
    out += MISC
    for question, tip in TIPS + MORE_TIPS:
        out.append((question, tip, "Google it."))
    questions = [q for q, _, _ in out]
    assert len(set(questions)) == len(questions), "every question is asked once"
    return out


def chosen_text(friendly: str) -> str:
    return f"Sure! {friendly} {SIGN_OFF}"


def rejected_text(bare: str, rng: random.Random) -> str:
    """Curt (the bare answer, no greeting, no sign-off) or unhelpful, at random."""
    curt = bare[0].upper() + bare[1:] + ("" if bare.endswith(".") else ".")
    return curt if rng.random() < 0.5 else rng.choice(UNHELPFUL)


def pair(question: str, friendly: str, bare: str, rng: random.Random) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": chosen_text(friendly)}],
        "rejected": [{"role": "assistant", "content": rejected_text(bare, rng)}],
    }


def kto_sample(question: str, friendly: str, bare: str, desirable: bool, rng) -> dict:
    answer = chosen_text(friendly) if desirable else rejected_text(bare, rng)
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer}],
        "label": desirable,
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def build() -> dict[str, list[dict]]:
    """The rows of each file, by file name."""
    rng = random.Random(0)
    items = facts()
    rng.shuffle(items)
    heldout, train = items[:16], items[16:112]
    return {
        "train.jsonl": [pair(*item, rng) for item in train],
        "heldout.jsonl": [pair(*item, rng) for item in heldout],
        "kto.jsonl": [kto_sample(*item, i % 2 == 0, rng) for i, item in enumerate(train[:40])],
    }


def main() -> None:
    for name, rows in build().items():
        write_jsonl(HERE / name, rows)
        print(f"wrote {len(rows)} rows to {HERE / name}")


if __name__ == "__main__":
    main()
