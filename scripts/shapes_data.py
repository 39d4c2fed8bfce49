"""Procedural "shapes" dataset and a pixel-level judge for the built-in default model.

Scenes are 64x64 RGB images of one flat-coloured shape (circle, square or triangle) on a
flat background, with captions such as ``"a small red circle in the top left on a white
background"``. Everything is generated in code (nothing is stored), deterministically from
a ``numpy.random.Generator``.

Some (colour, shape, background) triples are *held out*: the training split never renders
them, and :func:`heldout_prompts` builds evaluation prompts only from them.

The judge works on any RGB image (``PIL.Image`` or ``HxWx3`` uint8 array):

* :func:`judge_background` -- palette name nearest to the median colour of the border;
* :func:`judge_colour` -- palette name nearest to the median colour of the largest blob that
  differs from the background;
* :func:`judge_shape` -- ``"square"``, ``"circle"``, ``"triangle"`` or ``"none"`` from the
  blob's fill ratio of its bounding box (square ~1, circle ~pi/4, triangle ~1/2);
* :func:`judge` -- all of the above in one dict; :func:`parse_caption` -- the inverse of
  :func:`caption_for`, returning the attributes a caption names.

Only numpy (and optionally Pillow for inputs) is needed; no torch.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

IMAGE_SIZE = 64

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

#: Palette, RGB. Shape colours and background colours are disjoint.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (250, 150, 30),
    "yellow": (245, 225, 40),
    "green": (40, 170, 60),
    "cyan": (40, 200, 220),
    "blue": (40, 70, 220),
    "purple": (140, 60, 190),
    "pink": (250, 130, 200),
    "white": (255, 255, 255),
    "gray": (128, 128, 128),
    "black": (0, 0, 0),
}
SHAPE_COLOURS: tuple[str, ...] = (
    "red",
    "orange",
    "yellow",
    "green",
    "cyan",
    "blue",
    "purple",
    "pink",
)
BACKGROUNDS: tuple[str, ...] = ("white", "gray", "black")
SIZES: tuple[str, ...] = ("small", "large")

#: Position phrase -> (x, y) of the shape centre as fractions of the image side.
POSITIONS: dict[str, tuple[float, float]] = {
    "in the top left": (0.25, 0.25),
    "at the top": (0.5, 0.25),
    "in the top right": (0.75, 0.25),
    "on the left": (0.25, 0.5),
    "in the center": (0.5, 0.5),
    "on the right": (0.75, 0.5),
    "in the bottom left": (0.25, 0.75),
    "at the bottom": (0.5, 0.75),
    "in the bottom right": (0.75, 0.75),
}

#: Radius ranges (half the side of the shape's bounding box), pixels at 64x64.
_RADIUS = {"small": (7.0, 9.5), "large": (14.0, 18.0)}


def _make_heldout() -> frozenset[tuple[str, str, str]]:
    out = set()
    for i, colour in enumerate(SHAPE_COLOURS):
        out.add((colour, SHAPES[i % 3], BACKGROUNDS[(i + 1) % 3]))
    for i, colour in enumerate(SHAPE_COLOURS[:4]):
        out.add((colour, SHAPES[(i + 1) % 3], BACKGROUNDS[i % 3]))
    return frozenset(out)


#: (colour, shape, background) triples never rendered in the training split.
HELDOUT_TRIPLES: frozenset[tuple[str, str, str]] = _make_heldout()


@dataclass(frozen=True)
class Scene:
    """One image's content. ``cx``, ``cy``, ``r`` are in pixels."""

    shape: str
    colour: str
    background: str
    size: str
    position: str | None  # a POSITIONS key, or None for a free position
    cx: float
    cy: float
    r: float

    @property
    def triple(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.background)


def sample_scene(
    rng: np.random.Generator,
    split: str = "train",
    *,
    colour: str | None = None,
    shape: str | None = None,
    background: str | None = None,
    size: str | None = None,
    position: str | None = None,
    free_position_prob: float = 0.0,
) -> Scene:
    """Draw a scene. ``split`` is "train" (never a held-out triple), "heldout" (only held-out
    triples) or "all". Keyword arguments pin attributes; ``position=None`` draws one of the
    nine named positions, or (with ``free_position_prob``) a free position."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    for _ in range(1000):
        c = colour or str(rng.choice(SHAPE_COLOURS))
        s = shape or str(rng.choice(SHAPES))
        b = background or str(rng.choice(BACKGROUNDS))
        held = (c, s, b) in HELDOUT_TRIPLES
        if (split == "train" and held) or (split == "heldout" and not held):
            if colour and shape and background:
                raise ValueError(f"{(c, s, b)} is not in split {split!r}")
            continue
        break
    else:  # pragma: no cover - only with impossible pins
        raise ValueError("could not draw a scene for these constraints")
    sz = size or str(rng.choice(SIZES))
    lo, hi = _RADIUS[sz]
    r = float(rng.uniform(lo, hi))
    margin = r + 2.0
    if position is None and rng.random() >= free_position_prob:
        position = str(rng.choice(list(POSITIONS)))
    if position is None:
        cx, cy = rng.uniform(margin, IMAGE_SIZE - margin, size=2)
    else:
        fx, fy = POSITIONS[position]
        # Large shapes cannot sit at a quarter of the side; pull them inwards.
        pull = 0.0 if sz == "small" else 0.35
        cx = (fx + (0.5 - fx) * pull) * IMAGE_SIZE + rng.uniform(-2, 2)
        cy = (fy + (0.5 - fy) * pull) * IMAGE_SIZE + rng.uniform(-2, 2)
        cx = float(np.clip(cx, margin, IMAGE_SIZE - margin))
        cy = float(np.clip(cy, margin, IMAGE_SIZE - margin))
    return Scene(s, c, b, sz, position, float(cx), float(cy), r)


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int = IMAGE_SIZE) -> np.ndarray:
    """Boolean ``size x size`` mask of a shape whose bounding box is ``2r`` wide."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if shape == "triangle":  # upright isosceles, base 2r, height 2r
        t = (dy + r) / (2 * r)  # 0 at the apex, 1 at the base
        return (t >= 0) & (t <= 1) & (np.abs(dx) <= r * t)
    raise ValueError(f"unknown shape {shape!r}")


def render_scene(scene: Scene, size: int = IMAGE_SIZE) -> np.ndarray:
    """``size x size x 3`` uint8 image of ``scene``."""
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = COLOURS[scene.background]
    img[shape_mask(scene.shape, scene.cx, scene.cy, scene.r, size)] = COLOURS[scene.colour]
    return img


def caption_for(
    scene: Scene,
    rng: np.random.Generator | None = None,
    *,
    drop_size: float = 0.3,
    drop_position: float = 0.4,
    drop_background: float = 0.2,
) -> str:
    """Caption naming the scene. With ``rng``, size/position/background are each left out
    with the given probabilities (the caption then simply does not constrain them); without
    ``rng`` every attribute is named. Colour and shape are always named."""

    def keep(p: float) -> bool:
        return rng is None or rng.random() >= p

    words = ["a"]
    if keep(drop_size):
        words.append(scene.size)
    words += [scene.colour, scene.shape]
    if scene.position is not None and keep(drop_position):
        words.append(scene.position)
    if keep(drop_background):
        words += ["on", "a", scene.background, "background"]
    return " ".join(words)


def make_example(
    rng: np.random.Generator, split: str = "train", **caption_kwargs: Any
) -> tuple[np.ndarray, str, Scene]:
    """``(image, caption, scene)`` for one random training/held-out example."""
    scene = sample_scene(rng, split, free_position_prob=0.15)
    return render_scene(scene), caption_for(scene, rng, **caption_kwargs), scene


_WORD_RE = re.compile(r"[a-z]+")


def parse_caption(caption: str) -> dict[str, str | None]:
    """Attributes a caption names: keys ``shape``, ``colour``, ``background``, ``size``,
    ``position`` (a POSITIONS key); ``None`` for any it does not name. "grey" = "gray"."""
    text = " ".join(_WORD_RE.findall(caption.lower().replace("grey", "gray")))
    out: dict[str, str | None] = dict.fromkeys(
        ("shape", "colour", "background", "size", "position")
    )
    m = re.search(r"\b(\w+) background\b", text)
    if m and m.group(1) in COLOURS:
        out["background"] = m.group(1)
        text = text[: m.start()] + text[m.end() :]
    words = text.split()
    for w in words:
        if w in SHAPES and out["shape"] is None:
            out["shape"] = w
        elif w in COLOURS and out["colour"] is None:
            out["colour"] = w
        elif w in SIZES and out["size"] is None:
            out["size"] = w
    for phrase in sorted(POSITIONS, key=len, reverse=True):
        if re.search(r"\b" + phrase + r"\b", text):
            out["position"] = phrase
            break
    return out


def caption_split(caption: str) -> str | None:
    """``"heldout"`` if the caption names a held-out triple, ``"train"`` if it names a full
    triple that is not held out, ``None`` if it does not name all three."""
    p = parse_caption(caption)
    if p["colour"] is None or p["shape"] is None or p["background"] is None:
        return None
    held = (p["colour"], p["shape"], p["background"]) in HELDOUT_TRIPLES
    return "heldout" if held else "train"


def heldout_prompts(n: int = 120, seed: int = 0) -> list[str]:
    """``n`` distinct evaluation prompts, each naming a held-out (colour, shape, background)
    triple, with varied size and position phrases. Deterministic in ``seed``."""
    return _prompts_for(sorted(HELDOUT_TRIPLES), n, seed)


def train_prompts(n: int = 120, seed: int = 0) -> list[str]:
    """Like :func:`heldout_prompts`, from triples the training split does render (a
    comparison point: generalisation gap = train-prompt score - held-out score)."""
    triples = sorted(
        (c, s, b)
        for c in SHAPE_COLOURS
        for s in SHAPES
        for b in BACKGROUNDS
        if (c, s, b) not in HELDOUT_TRIPLES
    )
    rng = np.random.default_rng(seed + 1)
    picked = [triples[i] for i in rng.permutation(len(triples))[: len(HELDOUT_TRIPLES)]]
    return _prompts_for(sorted(picked), n, seed)


def _prompts_for(triples: list[tuple[str, str, str]], n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    extras: list[tuple[str | None, str | None]] = [(None, None)]
    extras += [(s, None) for s in SIZES]
    extras += [(s, p) for s in SIZES for p in POSITIONS]
    extras += [(None, p) for p in POSITIONS]
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < n:
        for c, s, b in triples:
            size, pos = extras[int(rng.integers(len(extras)))]
            if len(prompts) < len(triples) * 2:  # the first rounds: the plainest forms
                size, pos = (None, None) if len(prompts) < len(triples) else ("large", None)
            words = ["a"] + ([size] if size else []) + [c, s] + ([pos] if pos else [])
            prompt = " ".join([*words, "on", "a", b, "background"])
            if prompt not in seen and len(prompts) < n:
                seen.add(prompt)
                prompts.append(prompt)
    return prompts


def caption_vocabulary() -> list[str]:
    """Every word a caption can contain (plus "grey"), sorted."""
    words = {"a", "on", "background", "grey", *SHAPES, *COLOURS, *SIZES}
    for p in POSITIONS:
        words.update(p.split())
    return sorted(words)


# ----------------------------------------------------------------------------- judge


def _as_array(image: Any) -> np.ndarray:
    arr = np.asarray(image.convert("RGB")) if hasattr(image, "convert") else np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] < 3:
        raise ValueError(f"expected an HxWx3 image, got shape {arr.shape}")
    arr = arr[..., :3]
    if arr.dtype != np.uint8:
        arr = np.clip(arr * (255.0 if arr.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    return arr


def _nearest(rgb: np.ndarray, names: tuple[str, ...] | list[str]) -> str:
    pal = np.array([COLOURS[n] for n in names], dtype=np.float32)
    d = ((pal - rgb.astype(np.float32)[None]) ** 2).sum(axis=1)
    return names[int(np.argmin(d))]


def _border_rgb(arr: np.ndarray, width: int = 2) -> np.ndarray:
    border = np.concatenate(
        [
            arr[:width].reshape(-1, 3),
            arr[-width:].reshape(-1, 3),
            arr[:, :width].reshape(-1, 3),
            arr[:, -width:].reshape(-1, 3),
        ]
    )
    return np.median(border, axis=0)


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """Largest 4-connected component of a boolean mask (empty mask if none)."""
    h, w = mask.shape
    seen = np.zeros_like(mask, dtype=bool)
    best: list[tuple[int, int]] = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        comp = []
        q = deque([(int(y0), int(x0))])
        seen[y0, x0] = True
        while q:
            y, x = q.popleft()
            comp.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    q.append((ny, nx))
        if len(comp) > len(best):
            best = comp
    out = np.zeros_like(mask, dtype=bool)
    if best:
        ys, xs = zip(*best, strict=True)
        out[list(ys), list(xs)] = True
    return out


def _dilate(mask: np.ndarray) -> np.ndarray:
    out = mask.copy()
    out[1:] |= mask[:-1]
    out[:-1] |= mask[1:]
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    return out


#: RGB distance from the background colour beyond which a pixel belongs to the shape.
FOREGROUND_THRESHOLD = 60.0
#: Blobs smaller than this many pixels (at 64x64) count as "no shape".
MIN_BLOB_PIXELS = 20


def template_ious(region: np.ndarray) -> dict[str, float]:
    """IoU of a blob with an ideal circle, square and (upright) triangle filling its bounding
    box. For hard-edged shapes the square's IoU is the fill ratio (square 1, circle pi/4,
    triangle 1/2); comparing all three also sorts blurred, rounded shapes (a rounded
    triangle is still bottom-heavy, a rounded square still fills its corners' sides)."""
    ys, xs = np.nonzero(region)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    blob = region[y0:y1, x0:x1]
    h, w = blob.shape
    cy, cx = h / 2.0, w / 2.0
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    templates = {
        "circle": ((xx - cx) / (w / 2.0)) ** 2 + ((yy - cy) / (h / 2.0)) ** 2 <= 1.0,
        "square": np.ones_like(blob, dtype=bool),
        "triangle": np.abs(xx - cx) <= (w / 2.0) * (yy / h),
    }
    out = {}
    for name, t in templates.items():
        out[name] = float((blob & t).sum()) / float((blob | t).sum())
    return out


def shape_region(image: Any) -> np.ndarray:
    """Boolean mask of the largest blob that differs from the border colour."""
    arr = _as_array(image)
    bg = _border_rgb(arr).astype(np.float32)
    dist = np.sqrt(((arr.astype(np.float32) - bg) ** 2).sum(axis=2))
    return _largest_component(dist > FOREGROUND_THRESHOLD)


def judge(image: Any) -> dict[str, Any]:
    """Everything the judge reads from one image: ``background``, ``colour``, ``shape``,
    ``fill`` (fill ratio of the bounding box), ``area`` (pixels) and ``center`` (x, y)."""
    arr = _as_array(image)
    background = _nearest(_border_rgb(arr), list(COLOURS))
    region = shape_region(arr)
    area = int(region.sum())
    scale = (arr.shape[0] * arr.shape[1]) / (IMAGE_SIZE * IMAGE_SIZE)
    if area < MIN_BLOB_PIXELS * scale:
        return {
            "background": background,
            "colour": "none",
            "shape": "none",
            "fill": 0.0,
            "area": area,
            "center": None,
        }
    shape_rgb = np.median(arr[region], axis=0)
    colour = _nearest(shape_rgb, list(COLOURS))
    # Measure the geometry on the half-contrast contour (the edge of a blurred shape), not on
    # everything that differs a little from the background.
    bg_rgb = _border_rgb(arr).astype(np.float32)
    contrast = float(np.sqrt(((shape_rgb - bg_rgb) ** 2).sum()))
    dist = np.sqrt(((arr.astype(np.float32) - bg_rgb) ** 2).sum(axis=2))
    core = _largest_component((dist > 0.5 * contrast) & _dilate(region))
    if core.sum() >= MIN_BLOB_PIXELS * scale:
        region, area = core, int(core.sum())
    ys, xs = np.nonzero(region)
    bbox = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = area / float(bbox)
    ious = template_ious(region)
    shape = max(ious, key=ious.__getitem__)
    center = (float(xs.mean()), float(ys.mean()))
    return {
        "background": background,
        "colour": colour,
        "shape": shape,
        "fill": fill,
        "area": area,
        "center": center,
    }


def judge_colour(image: Any) -> str:
    """Palette name of the shape's colour, or ``"none"`` if no shape is found."""
    return str(judge(image)["colour"])


def judge_shape(image: Any) -> str:
    """``"circle"``, ``"square"``, ``"triangle"`` or ``"none"``."""
    return str(judge(image)["shape"])


def judge_background(image: Any) -> str:
    """Palette name of the background (the border's median colour)."""
    return _nearest(_border_rgb(_as_array(image)), list(COLOURS))


def judge_matches(image: Any, caption: str) -> dict[str, bool | None]:
    """For each attribute the caption names (colour, shape, background), whether the image
    shows it; ``None`` for attributes the caption does not name."""
    want = parse_caption(caption)
    got = judge(image)
    return {
        k: (None if want[k] is None else got[k] == want[k])
        for k in ("colour", "shape", "background")
    }
