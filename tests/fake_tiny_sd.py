"""The real diffusers adapter (`DiffusersT2IPipeline`) with faults on demand, for
end-to-end tests with model "tiny-sd". Importable by name
(`tests.fake_tiny_sd.PoisonTinySD`) so worker processes can load them too.
"""

from __future__ import annotations

import dataclasses
import os
import threading

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
