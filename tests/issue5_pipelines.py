"""Pipelines for the issue-5 end-to-end tests, importable by name for worker processes.

`PoisonTinySD` is the real batch-capable diffusers adapter (load it with model
"tiny-sd") that raises for any wave holding a prompt with "poison" in it, the way a
request with bad input breaks a whole fused forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline

if TYPE_CHECKING:
    from diffbatch.outputs import DiffusionOutput
    from diffbatch.pipelines.interface import DiffusionRequestBatch

POISON = "poison"


class PoisonTinySD(DiffusersT2IPipeline):
    """The diffusers adapter, failing every forward whose wave holds a poisoned prompt."""

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        poisoned = [i for i, p in enumerate(batch.prompts) if POISON in p]
        if poisoned:
            raise RuntimeError(f"poisoned prompt at wave position(s) {poisoned}")
        return super().forward(batch)
