"""The real diffusers adapter (`DiffusersT2IPipeline`) with faults on demand, for
end-to-end tests with model "tiny-sd". Importable by name
(`tests.fake_tiny_sd.PoisonTinySD`) so worker processes can load them too.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any

from diffbatch.outputs import DiffusionOutput
from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interface import DiffusionRequestBatch
from tests.fake_pipelines import HANG, POISON, touch


class PoisonTinySD(DiffusersT2IPipeline):
    """The real diffusers adapter, failing every forward whose wave holds a poisoned prompt."""

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        poisoned = [i for i, p in enumerate(batch.prompts) if POISON in p]
        if poisoned:
            raise RuntimeError(f"poisoned prompt at wave position(s) {poisoned}")
        return super().forward(batch)


class HangingTinySD(DiffusersT2IPipeline):
    """The real diffusers adapter, whose call for a prompt containing `HANG` never
    returns: the worker's main thread is stuck (its heartbeat thread lives on)."""

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        if any(HANG in p for p in batch.prompts):
            threading.Event().wait()
        return super().forward(batch)


class MarkedTinySD(DiffusersT2IPipeline):
    """The real diffusers adapter; touches $DIFFBATCH_FAKE_MARKER once a wave (not the
    warm-up) reaches its denoising loop."""

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        marker = os.environ.get("DIFFBATCH_FAKE_MARKER")
        if marker and batch.prompts != ["warm-up"]:
            check = batch.should_stop

            def should_stop() -> bool:
                if not os.path.exists(marker):
                    touch(marker)
                return check()

            batch = dataclasses.replace(batch, should_stop=should_stop)
        return super().forward(batch)


class StepFaultTinySD(DiffusersT2IPipeline):
    """The real diffusers adapter (step contract included) with faults after a given
    denoising step of a request, in that request's own per-step hook, so in step mode
    they strike mid-tick with its batch mates in the running batch. The prompt's first
    word chooses (NAME: the last word, a marker file in $DIFFBATCH_FAKE_MARKER_DIR):

    - "crash-after-K ...": kill the worker (SIGKILL) after step K, every time;
    - "hang-after-K NAME": after step K, if NAME does not exist, touch it and hang (a
      tick for a test to kill or freeze the worker in); once it exists, run on (the
      re-run). The hook runs after the step's partial images were sent.
    """

    def _step_hooks(self, batch: DiffusionRequestBatch, pipe: Any, previews: Any, *,
                    interrupt: bool = True) -> dict[str, Any]:
        hooks = super()._step_hooks(batch, pipe, previews, interrupt=interrupt)
        words = batch.prompts[0].split()
        fault, _, after = words[0].rpartition("-after-")
        if fault not in ("crash", "hang") or not after.isdigit():
            return hooks
        marker = os.path.join(os.environ.get("DIFFBATCH_FAKE_MARKER_DIR", ""), words[-1])
        inner = hooks.get("callback_on_step_end")

        def on_step_end(pipe: Any, step: int, timestep: Any,
                        callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            if inner is not None:
                callback_kwargs = inner(pipe, step, timestep, callback_kwargs)
            if step + 1 == int(after):
                if fault == "crash":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif not os.path.exists(marker):
                    touch(marker)
                    threading.Event().wait()
            return callback_kwargs

        return {**hooks, "callback_on_step_end": on_step_end}
