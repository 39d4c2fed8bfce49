"""Partial images in a wave: which denoising steps owe previews to which requests.

A request with `partial_images = k` gets up to k previews of each of its images,
taken after evenly spaced denoising steps before the last (`preview_steps`: the last
step's prediction is the final image itself). Requests in one wave may ask for
different k, or none: `partial_images` is not in the batch key.

A pipeline that can preview asks its wave for a plan once it knows how many steps
it runs (`DiffusionRequestBatch.partial_image_plan`); None means nobody in the wave
asked (or nobody listens), and the pipeline does nothing extra. After each step it
asks the plan which rows of the wave's B*n samples owe a preview now (`rows_at`),
decodes only those, and hands the images back (`send`); the plan turns each into a
`PartialImage` of its request and passes it to the runner, which ships it to the
engine while the wave still runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diffbatch.outputs import PartialImage

if TYPE_CHECKING:
    import torch

    from diffbatch.pipelines.interface import DiffusionRequestBatch


def preview_steps(count: int, num_steps: int) -> list[int]:
    """The steps (counted 1-based, as steps done) after which `count` previews are taken
    in a loop of `num_steps`: evenly spaced, at most one per step, never after the last
    step. Fewer than `count` when the loop is too short; none for one step."""
    steps = {math.floor(num_steps * (i + 1) / (count + 1) + 0.5) for i in range(count)}
    return sorted(step for step in steps if 1 <= step < num_steps)


@dataclass
class PartialImagePlan:
    """Who owes which preview after which step, for one wave's loop of `num_steps`."""

    num_steps: int
    # step -> rows of the wave's B*n samples that owe a preview after it, ascending
    rows: dict[int, list[int]]
    # (row, step) -> (request_id, image index in the request, partial_image_index)
    targets: dict[tuple[int, int], tuple[str, int, int]]
    send_partial: Callable[[PartialImage], None] = field(repr=False)

    @classmethod
    def for_batch(cls, batch: DiffusionRequestBatch, num_steps: int) -> PartialImagePlan | None:
        """The plan of `batch`, or None when no request of it owes a preview."""
        if batch.on_partial_image is None:
            return None
        n = batch.num_outputs_per_prompt
        rows: dict[int, list[int]] = {}
        targets: dict[tuple[int, int], tuple[str, int, int]] = {}
        for i, request in enumerate(batch.requests):
            steps = preview_steps(request.sampling_params.partial_images, num_steps)
            for index, step in enumerate(steps):
                for image_index in range(n):
                    row = i * n + image_index
                    rows.setdefault(step, []).append(row)
                    targets[(row, step)] = (request.request_id, image_index, index)
        if not rows:
            return None
        return cls(num_steps, rows, targets, batch.on_partial_image)

    def rows_at(self, step: int) -> list[int]:
        """Rows that owe a preview after `step` (1-based steps done); [] for none."""
        return self.rows.get(step, [])

    def send(self, step: int, images: torch.Tensor) -> None:
        """Hand out the previews of `step`: `images` [len(rows_at(step)), C, H, W], float
        in [0, 1], one per row in `rows_at(step)` order."""
        rows = self.rows_at(step)
        if len(images) != len(rows):
            raise ValueError(f"step {step} owes {len(rows)} partial image(s), got "
                             f"{len(images)}")
        for row, image in zip(rows, images, strict=True):
            request_id, image_index, index = self.targets[(row, step)]
            self.send_partial(PartialImage(request_id, index, image_index, step,
                                           self.num_steps, image))
