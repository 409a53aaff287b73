"""examples/data/vision/make_shapes.py: the vision demo's pictures and their questions."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location(
        "make_shapes", ROOT / "examples/data/vision/make_shapes.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _nearest(shapes, rgb) -> str:
    return min(
        shapes.COLOURS, key=lambda c: sum((a - b) ** 2 for a, b in zip(shapes.COLOURS[c], rgb))
    )


def test_the_named_colour_is_the_shapes_and_the_shape_is_filled_like_one(shapes):
    """The label is right: the most common non-background colour is the named one, and the
    filled share of the bounding box is a circle's (pi/4), a square's (1) or a triangle's (1/2)."""
    filled_share = {"circle": 0.785, "square": 1.0, "triangle": 0.5}
    rng = random.Random(3)
    for _ in range(30):
        picture = shapes.draw(rng, 64)
        pixels = list(picture.image.getdata())
        # a shape (side <= 95% of the picture, near the middle) covers no corner
        corners = [pixels[0], pixels[63], pixels[-64], pixels[-1]]
        background = max(corners, key=corners.count)
        shape_pixels = [p for p in pixels if p != background]
        assert _nearest(shapes, max(set(shape_pixels), key=shape_pixels.count)) == picture.colour
        mask = [p != background for p in pixels]  # the shape's pixels, row-major
        xs = [i % 64 for i, inside in enumerate(mask) if inside]
        ys = [i // 64 for i, inside in enumerate(mask) if inside]
        area = (max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1)
        assert abs(sum(mask) / area - filled_share[picture.shape]) < 0.12, picture.shape


def test_splits_are_messages_with_images_and_seeds_differ(shapes, tmp_path):
    train = shapes.write_split(tmp_path, "train", 8, seed=0, size=32)
    heldout = shapes.write_split(tmp_path, "heldout", 8, seed=1, size=32)
    rows = json.loads(train.read_text())
    assert len(rows) == 16  # both questions about each picture
    for shape_row, colour_row in zip(rows[::2], rows[1::2]):
        assert shape_row["images"] == colour_row["images"]
        assert shape_row["messages"][-1]["content"] in shapes.SHAPES
        assert colour_row["messages"][-1]["content"] in shapes.COLOURS
    for row in rows:
        system, user, answer = row["messages"]
        assert user["content"].startswith("<image>") and user["content"].count("<image>") == 1
        assert Image.open(tmp_path / row["images"][0]).size == (32, 32)
    pictures = [(tmp_path / r["images"][0]).read_bytes() for r in rows]
    others = [(tmp_path / r["images"][0]).read_bytes() for r in json.loads(heldout.read_text())]
    assert not set(pictures) & set(others)
