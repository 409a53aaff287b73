"""Generate the vision demo's data: pictures of one coloured shape and questions about it.

Each picture is a light background (white or light grey) with one circle, square or
triangle in one of six colours, nearly as large as the picture and near the middle. Each
picture gets both questions, "What shape is this?" and "What colour is the shape?" (two
rows), answered in one word. The rows are OpenAI-style `messages` with LLaMA-Factory's
`images` column and `<image>` placeholder (its mllm_demo layout), image paths relative to
the dataset file; a `dataset_info.json` beside it names the file for LLaMA-Factory too.
Different seeds give different pictures: the held-out split is the same recipe with another
seed.

    python examples/data/vision/make_shapes.py --out DIR [--count 800] [--seed 0] [--size 64]
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = ((255, 255, 255), (225, 225, 225))  # light: no shape colour is near them
QUESTIONS = {"shape": "What shape is this?", "colour": "What colour is the shape?"}
SYSTEM = "Answer with one word."
JITTER = 12  # colours vary by up to this much per channel, so no two reds are equal


@dataclass(frozen=True)
class Picture:
    shape: str
    colour: str
    image: Image.Image


def draw(rng: random.Random, size: int) -> Picture:
    """One picture: a random shape, colour, background and size, placed near the middle
    (a small model learns shapes it sees in one place from a few hundred pictures; anywhere
    in the picture needs far more of them)."""
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    image = Image.new("RGB", (size, size), _jitter(rng, rng.choice(BACKGROUNDS)))
    # Nearly the whole picture: the demo's tower sees a 4x4 grid of patches, and circle,
    # square and triangle differ in the corner patches. A smaller shape leaves a corner patch
    # mostly background whatever it is (a square of 70% covers 16% of one), and averaged
    # patch features then separate the shapes far less (linear probe: 91% vs 99%).
    side = rng.uniform(0.85, 0.95) * size
    room = size - side  # shifted by up to a fifth of the room either way from the middle
    left, top = (room / 2 + rng.uniform(-0.2, 0.2) * room for _ in range(2))
    box = (left, top, left + side, top + side)
    fill = _jitter(rng, COLOURS[colour])
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon(
            [(left + side / 2, top), (left + side, top + side), (left, top + side)], fill=fill
        )
    return Picture(shape=shape, colour=colour, image=image)


def _jitter(rng: random.Random, rgb: tuple[int, int, int]) -> tuple[int, ...]:
    return tuple(min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in rgb)


def row(picture_path: str, kind: str, answer: str) -> dict:
    """One dataset row: a question about the picture and its one-word answer."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "<image>" + QUESTIONS[kind]},
            {"role": "assistant", "content": answer},
        ],
        "images": [picture_path],
    }


def write_split(out: Path, name: str, count: int, seed: int, size: int) -> Path:
    """`count` pictures under out/images/<name>_N.png and their rows in out/<name>.json."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(count):
        picture = draw(rng, size)
        relative = f"images/{name}_{index:04d}.png"
        picture.image.save(out / relative)
        rows.append(row(relative, "shape", picture.shape))
        rows.append(row(relative, "colour", picture.colour))
    path = out / f"{name}.json"
    path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return path


def write_dataset_info(out: Path, names: list[str]) -> None:
    """LLaMA-Factory's entry for each split (its mllm_demo layout)."""
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user"}
    tags |= {"assistant_tag": "assistant", "system_tag": "system"}
    entry = {"formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"}}
    info = {f"shapes_{n}": {"file_name": f"{n}.json", **entry, "tags": tags} for n in names}
    (out / "dataset_info.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the images and the splits")
    parser.add_argument("--count", type=int, default=800, help="training pictures")
    parser.add_argument("--heldout", type=int, default=120, help="held-out pictures")
    parser.add_argument("--seed", type=int, default=0, help="training seed (held-out: seed+1)")
    parser.add_argument("--size", type=int, default=64, help="picture side in pixels")
    args = parser.parse_args()
    out = Path(args.out)
    write_split(out, "train", args.count, args.seed, args.size)
    write_split(out, "heldout", args.heldout, args.seed + 1, args.size)
    write_dataset_info(out, ["train", "heldout"])
    print(f"wrote {args.count} training and {args.heldout} held-out pictures under {out}")


if __name__ == "__main__":
    main()
