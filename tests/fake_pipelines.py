"""Small pipelines at the pipeline seam, for scheduler/engine/runner tests.

Importable by name (`tests.fake_pipelines.FakeBatchPipeline`) so worker processes
can load them too. Images depend only on each request's seed and prompt, like a
real batch-invariant pipeline.

Edits (an input image, a mask) are supported: the output mixes the request's noise
(a share of `strength`: the noise its generation would give) with its image, only
where its mask paints.

Partial images: a request that asks for them gets, after step s of its S steps, its
final images scaled by s / S (`send_partial_images`).

A prompt containing `POISON` makes `FakeBatchPipeline` (and `PoisonTinySD` in
`tests.fake_tiny_sd`) fail the whole wave that holds it, the way a request with bad
input breaks a fused forward; one with `LATE_POISON` fails `FakeBatchPipeline`'s wave
once its partial images are sent.

Nothing here imports diffusers: a worker that loads one of these starts without it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import zlib
from typing import Any

import torch

from diffbatch.outputs import DiffusionOutput
from diffbatch.pipelines.interface import BasePipeline, DiffusionRequestBatch, PipelineInfo

POISON = "poison"  # a prompt containing it fails its wave
LATE_POISON = "fails late"  # ...after the wave sent its partial images
HANG = "hangs forever"  # `tests.fake_tiny_sd.HangingTinySD` never finishes a call holding it


def fake_images(prompt: str, generators: list[torch.Generator], h: int, w: int) -> torch.Tensor:
    """[n, 3, h, w] in [0, 1]: noise from each generator, offset by the prompt."""
    offset = (zlib.crc32(prompt.encode()) % 1000) / 1000.0
    images = [torch.rand(3, h, w, generator=g) * 0.5 + offset * 0.5 for g in generators]
    return torch.stack(images)


def make_fake_adapter(folder: str | os.PathLike[str]) -> str:
    """A folder holding a small valid LoRA weights file (the fake pipelines never apply
    it; the runner reads and checks it as it would a real one); returns its path."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({"unet.layer.lora_A.weight": torch.full((2, 4), 0.5)},
              os.path.join(folder, "pytorch_lora_weights.safetensors"))
    return str(folder)


def send_partial_images(batch: DiffusionRequestBatch, images: torch.Tensor,
                        num_steps: int) -> bool:
    """Send the previews the wave owes: after step s, rows of `images` [B*n, 3, H, W]
    (the final images) times s / num_steps. False when it owes none."""
    plan = batch.partial_image_plan(num_steps)
    if plan is None:
        return False
    for step in sorted(plan.rows):
        plan.send(step, images[plan.rows_at(step)] * (step / num_steps))
    return True


class FakeBatchPipeline(BasePipeline):
    """Batch-capable; raises for a wave containing a prompt with "poison" in it."""

    supports_request_batch = True
    wave_sizes: list[int] = []  # in-process record of every forward's batch size

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.cache_refreshes = 0
        self.lora_loads: list[str] = []  # adapter names loaded, in order
        self.lora_unloads: list[str] = []
        self.lora_waves: list[list[tuple[tuple[str, float], ...]]] = []  # per forward
        if os.environ.get("DIFFBATCH_FAKE_FAIL_LOAD"):
            raise RuntimeError("fake pipeline refused to load")

    @classmethod
    def from_pretrained(cls, model: str | None = None, **kwargs: Any) -> FakeBatchPipeline:
        return cls(**kwargs)

    def info(self) -> PipelineInfo:
        return PipelineInfo(
            name=type(self).__name__, default_height=16, default_width=16,
            default_num_inference_steps=2, default_guidance_scale=5.0, size_multiple=8,
            default_strengths={"image-to-image": 0.8, "inpaint": 1.0},
        )

    def refresh_cache(self) -> None:
        self.cache_refreshes += 1

    def load_lora(self, name: str, weights: Any) -> None:
        self.lora_loads.append(name)

    def unload_lora(self, name: str) -> None:
        self.lora_unloads.append(name)

    def set_lora_wave(self, stacks: Any, num_outputs_per_prompt: int) -> None:
        if stacks is not None:  # None: the runner clearing the stacks after a forward
            self.lora_waves.append(list(stacks))

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        type(self).wave_sizes.append(len(batch))
        if any(POISON in p for p in batch.prompts):
            raise RuntimeError("poisoned prompt in this wave")
        if any(p == "warm-up" for p in batch.prompts) and os.environ.get(
            "DIFFBATCH_FAKE_FAIL_WARMUP"
        ):
            raise RuntimeError("warm-up refused")
        outputs = self.make_outputs(batch)
        send_partial_images(batch, torch.cat([o.images for o in outputs]),
                            batch.requests[0].sampling_params.num_inference_steps or 1)
        if any(LATE_POISON in p for p in batch.prompts):
            raise RuntimeError("poisoned prompt in this wave, found late")
        return outputs

    def make_outputs(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """The wave's outputs, one per request (the rule of the module docstring)."""
        n = batch.num_outputs_per_prompt
        outputs = []
        for i, request in enumerate(batch.requests):
            params = request.sampling_params
            gens = batch.generators[i * n:(i + 1) * n]
            images = fake_images(request.prompt, gens, params.height, params.width)
            if params.image is not None:  # an edit: `strength` noise, the rest its image
                source = params.image.permute(2, 0, 1).float() / 255.0  # [3, H, W]
                edited = images * params.strength + source * (1.0 - params.strength)
                paint = None if params.mask is None else params.mask.bool()
                images = edited if paint is None else torch.where(paint, edited, source)
            outputs.append(DiffusionOutput(request.request_id, images=images))
        return outputs


class FakeSinglePipeline(FakeBatchPipeline):
    """Not batch-capable: the engine must only pass batches of one."""

    supports_request_batch = False

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        assert len(batch) == 1, f"per-request pipeline got a batch of {len(batch)}"
        return super().forward(batch)


def is_start_up(batch: DiffusionRequestBatch) -> bool:
    """Whether `batch` is the engine's own start-up work: its warm-up request or an
    "auto" calibration wave (a gate lets these through)."""
    return batch.prompts == ["warm-up"] or all(
        p.startswith("calibration image") for p in batch.prompts)


class GatedPipeline(FakeBatchPipeline):
    """Blocks each forward until `release` is set; `entered` is set on entry.

    In-process only (executor="inproc"): tests drive it through the class events.
    """

    entered = threading.Event()
    release = threading.Event()

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        if is_start_up(batch):
            return super().forward(batch)
        type(self).entered.set()
        type(self).release.wait(timeout=60)
        return super().forward(batch)


class OverheadGatedPipeline(GatedPipeline):
    """A `GatedPipeline` whose every forward also pays a fixed `OVERHEAD_S`, whatever
    its size, as a real model's launch and weight reads do: its cost curve gives
    "auto" capacity a clear gain from batching, where the plain fake's is noise."""

    OVERHEAD_S = 0.02

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        threading.Event().wait(self.OVERHEAD_S)  # the simulated fixed cost
        return super().forward(batch)


class PreviewGatedPipeline(GatedPipeline):
    """A `GatedPipeline` that, once released, sends its wave's partial images and, if
    it owed any, sets `previewed` and holds the wave until `finish` is set: a stream
    stays at its partial images for as long as a test needs."""

    previewed = threading.Event()
    finish = threading.Event()

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        gate = type(self)
        if is_start_up(batch):
            return self.make_outputs(batch)
        gate.entered.set()
        gate.release.wait(timeout=60)
        outputs = self.make_outputs(batch)
        if send_partial_images(batch, torch.cat([o.images for o in outputs]),
                               batch.requests[0].sampling_params.num_inference_steps or 1):
            gate.previewed.set()
            gate.finish.wait(timeout=60)
        return outputs


def make_gate(base: type[GatedPipeline] = GatedPipeline,
              module: str = __name__) -> type[GatedPipeline]:
    """A subclass of `base` with fresh events (`entered`, `release`, and the others
    `base` declares), so tests do not share a gate's state."""
    events = {name for cls in base.__mro__ for name, value in vars(cls).items()
              if isinstance(value, threading.Event)}
    return type("TestGate", (base,), {**{name: threading.Event() for name in events},
                                      "__module__": module})


class WrongCountPipeline(FakeBatchPipeline):
    """Breaks the contract: returns one output too few."""

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        return super().forward(batch)[:-1] if len(batch) > 1 else super().forward(batch)


class WrongTypePipeline(FakeBatchPipeline):
    """Breaks the contract: returns dicts instead of DiffusionOutput."""

    def forward(self, batch: DiffusionRequestBatch) -> list[Any]:
        outs = super().forward(batch)
        return outs if batch.prompts == ["warm-up"] else [{"images": o.images} for o in outs]


class NotAPipeline:
    """Has neither from_pretrained nor forward."""


class SlowPipeline(FakeBatchPipeline):
    """Touches the file named by $DIFFBATCH_FAKE_MARKER when a real wave starts, then
    works for up to a minute: a wave long enough for a test to kill the worker mid-wave.
    """

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        marker = os.environ.get("DIFFBATCH_FAKE_MARKER")
        if marker and "slow" in batch.prompts[0]:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait(60)  # simulated long forward
        return super().forward(batch)


class SmallModelPipeline(FakeBatchPipeline):
    """Declares a model limit of 32x32 pixels per image."""

    def info(self) -> PipelineInfo:
        return dataclasses.replace(super().info(), model_max_pixels=32 * 32)


class NoEditPipeline(FakeBatchPipeline):
    """Declares no edit tasks, like a diffusers family without image-to-image pipelines."""

    def info(self) -> PipelineInfo:
        return dataclasses.replace(super().info(), default_strengths={})


class ImageToImagePipeline(FakeBatchPipeline):
    """Declares image-to-image edits only, like a family without an inpaint pipeline."""

    def info(self) -> PipelineInfo:
        return dataclasses.replace(super().info(), default_strengths={"image-to-image": 0.8})


def touch(path: str) -> None:
    """Write this process's pid to `path` (a marker a test waits for)."""
    with open(path, "w") as f:
        f.write(str(os.getpid()))


class FaultyPipeline(FakeBatchPipeline):
    """Faults on demand, chosen by a wave's prompts. Marker files go to
    $DIFFBATCH_FAKE_MARKER_DIR, named by the prompt's last word (NAME):

    - "steps NAME": touch NAME, send a gray partial image to each request of the wave
      that asked for one, then run "denoising steps" (10 ms each, up to ten minutes),
      checking `batch.check_interrupt()` between them; touch NAME.interrupted when the
      wave was stopped that way;
    - "hang-once NAME": if NAME does not exist, touch it and hang (a wave for a test
      to kill or freeze the worker in); once it exists, run normally (the re-run);
    - "crash ...": kill the worker process (SIGKILL), every time, alone or batched, as
      a segfault in native code would.

    Loading waits while the file `hold-load` exists there (up to a minute), so a test
    can hold a replacement worker in its start-up for as long as it needs.
    """

    @classmethod
    def from_pretrained(cls, model: str | None = None, **kwargs: Any) -> FakeBatchPipeline:
        hold = os.path.join(os.environ.get("DIFFBATCH_FAKE_MARKER_DIR", ""), "hold-load")
        idle, deadline = threading.Event(), time.monotonic() + 60
        while os.path.exists(hold) and time.monotonic() < deadline:
            idle.wait(0.01)
        return super().from_pretrained(model, **kwargs)

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        folder = os.environ.get("DIFFBATCH_FAKE_MARKER_DIR", "")
        for prompt in batch.prompts:
            words = prompt.split()
            marker = os.path.join(folder, words[-1])
            if words[0] == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif words[0] == "hang-once" and not os.path.exists(marker):
                touch(marker)
                threading.Event().wait(600)
            elif words[0] == "steps":
                touch(marker)
                self._step(batch, marker)
        return super().forward(batch)

    @staticmethod
    def _step(batch: DiffusionRequestBatch, marker: str) -> None:
        params = batch.requests[0].sampling_params
        gray = torch.full((len(batch) * batch.num_outputs_per_prompt, 3, params.height,
                           params.width), 0.5)
        plan = batch.partial_image_plan(2)  # one preview (after step 1 of 2), sent now
        if plan is not None:
            plan.send(1, gray[plan.rows_at(1)])
        idle = threading.Event()
        try:
            for _ in range(60_000):
                batch.check_interrupt()
                idle.wait(0.01)
        except Exception:
            touch(marker + ".interrupted")
            raise
