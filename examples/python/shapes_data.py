"""The sweep's data: a labelled JPEG image dataset drawn with PIL, and the
CPU input pipeline a trainer would normally run on it.

Ten classes of shapes and textures (disk, square, triangle, plus, ring,
horizontal, vertical and diagonal stripes, checkerboard, dots), each image with
random position, size, rotation, colours, blur and noise, saved as JPEG files
in <root>/<split>/<class>/<n>.jpg. Generation is deterministic per seed and
cached: a later run reuses the images and draws only those it lacks.

The pipeline is the usual one: decode the JPEG with PIL, random resized crop,
random horizontal flip, convert to float32 CHW and normalise.
"""

from __future__ import annotations

import math
import os
import random
import signal
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CLASSES = [
    "disk",
    "square",
    "triangle",
    "plus",
    "ring",
    "hstripes",
    "vstripes",
    "diagonal",
    "checker",
    "dots",
]
SOURCE_SIZE = 128  # stored JPEGs are 128x128
CROP = 40  # the network sees 40x40
MEAN = np.array([0.5, 0.5, 0.5], np.float32)
STD = np.array([0.25, 0.25, 0.25], np.float32)
FORMAT_VERSION = 1


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.randrange(256) for _ in range(3))


def _contrasting(rng: random.Random, other: tuple[int, int, int]) -> tuple[int, int, int]:
    while True:
        c = _colour(rng)
        if sum(abs(a - b) for a, b in zip(c, other)) > 180:
            return c


def _rotated(points, cx, cy, angle):
    ca, sa = math.cos(angle), math.sin(angle)
    return [(cx + x * ca - y * sa, cy + x * sa + y * ca) for x, y in points]


def draw(label: int, rng: random.Random, size: int = SOURCE_SIZE) -> Image.Image:
    """One size x size RGB image of class `label`."""
    s = size
    k = s / SOURCE_SIZE  # patterns keep their size relative to the image
    bg = _colour(rng)
    fg = _contrasting(rng, bg)
    img = Image.new("RGB", (s, s), bg)
    d = ImageDraw.Draw(img)
    r = rng.uniform(0.18, 0.34) * s  # object radius
    cx, cy = rng.uniform(r, s - r), rng.uniform(r, s - r)
    angle = rng.uniform(0, 2 * math.pi)
    name = CLASSES[label]
    if name == "disk":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif name == "square":
        d.polygon(_rotated([(-r, -r), (r, -r), (r, r), (-r, r)], cx, cy, angle), fill=fg)
    elif name == "triangle":
        pts = [(r * math.cos(a), r * math.sin(a)) for a in (0, 2 * math.pi / 3, 4 * math.pi / 3)]
        d.polygon(_rotated(pts, cx, cy, angle), fill=fg)
    elif name == "plus":
        w = r * rng.uniform(0.25, 0.4)
        for pts in ([(-r, -w), (r, -w), (r, w), (-r, w)], [(-w, -r), (w, -r), (w, r), (-w, r)]):
            d.polygon(_rotated(pts, cx, cy, angle), fill=fg)
    elif name == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fg, width=max(2, int(r * rng.uniform(0.2, 0.35))))
    elif name in ("hstripes", "vstripes", "diagonal"):
        period = rng.uniform(8, 16) * k
        width = period * rng.uniform(0.35, 0.6)
        phase = rng.uniform(0, period)
        if name == "diagonal":  # either diagonal: a flipped image stays in its class
            theta = rng.choice([1, -1]) * math.pi / 4 + rng.uniform(-0.2, 0.2)
        else:
            theta = (0.0 if name == "hstripes" else math.pi / 2) + rng.uniform(-0.15, 0.15)
        L = 2 * s
        k = -L
        while k < L:
            off = k + phase
            pts = [(-L, off), (L, off), (L, off + width), (-L, off + width)]
            d.polygon(_rotated(pts, s / 2, s / 2, theta), fill=fg)
            k += period
    elif name == "checker":
        cell = rng.uniform(8, 16) * k
        theta = rng.uniform(-0.2, 0.2)
        n = int(2 * s / cell) + 2
        for i in range(-n, n):
            for j in range(-n, n):
                if (i + j) % 2 == 0:
                    pts = [(i * cell, j * cell), ((i + 1) * cell, j * cell)]
                    pts += [((i + 1) * cell, (j + 1) * cell), (i * cell, (j + 1) * cell)]
                    d.polygon(_rotated(pts, s / 2, s / 2, theta), fill=fg)
    elif name == "dots":
        step = rng.uniform(12, 20) * k
        rad = step * rng.uniform(0.2, 0.32)
        ox, oy = rng.uniform(0, step), rng.uniform(0, step)
        y = oy - step
        while y < s + step:
            x = ox - step
            while x < s + step:
                d.ellipse([x - rad, y - rad, x + rad, y + rad], fill=fg)
                x += step
            y += step
    else:  # pragma: no cover
        raise ValueError(label)
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 1.2) * k))
    noise = np.random.default_rng(rng.randrange(1 << 31)).normal(0, rng.uniform(4, 16), (s, s, 3))
    arr = np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def image_path(folder: Path, split: str, n: int) -> Path:
    """Image n of a split; its label is n % 10, so every prefix is balanced."""
    return Path(folder) / split / CLASSES[n % len(CLASSES)] / f"{n:06d}.jpg"


def _write_chunk(args) -> int:
    folder, split, seed, size, indices = args
    for n in indices:
        rng = random.Random(f"{seed}/{split}/{n}")
        path = image_path(folder, split, n)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")  # concurrent runs never share one
        draw(n % len(CLASSES), rng, size).save(tmp, format="JPEG", quality=rng.randint(75, 95))
        os.replace(tmp, path)  # an interrupted run leaves no half-written image
    return len(indices)


def ensure_dataset(
    root: Path, n_train: int, n_val: int, seed: int = 0, workers: int | None = None, size: int = SOURCE_SIZE
) -> Path:
    """Makes sure images 0..n-1 of both splits, size x size pixels, exist
    under root (generated once, deterministically per seed; later runs
    reuse them and only draw what is missing) and returns the dataset
    folder."""
    name = f"shapes-v{FORMAT_VERSION}-seed{seed}" + ("" if size == SOURCE_SIZE else f"-{size}px")
    folder = Path(root) / name
    jobs = []
    for split, n in (("train", n_train), ("val", n_val)):
        for c in CLASSES:
            (folder / split / c).mkdir(parents=True, exist_ok=True)
        missing = [i for i in range(n) if not image_path(folder, split, i).exists()]
        jobs += [(folder, split, seed, size, missing[k : k + 200]) for k in range(0, len(missing), 200)]
    if jobs:
        ex = ProcessPoolExecutor(min(len(jobs), workers or os.cpu_count() or 1), initializer=_ignore_sigint)
        try:
            for _ in ex.map(_write_chunk, jobs):
                pass
        finally:  # on Ctrl-C, drop the chunks not started yet
            ex.shutdown(wait=True, cancel_futures=True)
    return folder


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def list_split(folder: Path, split: str, n: int) -> list[tuple[str, int]]:
    """(path, label) of the first n images of a split."""
    return [(str(image_path(folder, split, i)), i % len(CLASSES)) for i in range(n)]


def to_tensor(img: Image.Image) -> np.ndarray:
    """HWC uint8 image -> normalised float32 CHW array."""
    x = np.asarray(img, np.float32) * (1 / 255)
    x = (x - MEAN) / STD
    return np.ascontiguousarray(x.transpose(2, 0, 1))


class ShapesDataset:
    """A map-style dataset (torch's Dataset protocol) over one split.

    train: decode, random resized crop (scale 0.5-1, ratio 3/4-4/3) to
    CROP x CROP, random horizontal flip, normalise. Otherwise: decode, resize
    the whole image to CROP x CROP, normalise.
    """

    def __init__(self, folder: Path, split: str, n: int, train: bool):
        self.items = list_split(folder, split, n)
        self.train = train

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        with Image.open(path) as f:
            img = f.convert("RGB")
        if self.train:
            w, h = img.size
            for _ in range(10):
                area = w * h * random.uniform(0.5, 1.0)
                ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
                cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
                if cw <= w and ch <= h:
                    break
            else:
                cw, ch = w, h
            x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
            img = img.resize((CROP, CROP), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            img = img.resize((CROP, CROP), Image.BILINEAR)
        return to_tensor(img), label
