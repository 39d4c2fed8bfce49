"""Every place diffbatch changes what a diffusers module does, and why.

diffbatch serves diffusers pipelines without forking them: it calls each pipeline's
own `__call__` and changes what some of its modules do during the call. All of that
lives in this package, and goes through one of two mechanisms:

- a module's `forward` is routed through a diffusers hook (`hooks.route_forward`:
  `HookRegistry`/`ModelHook`, the mechanism diffusers' own caches use), or observed
  with plain PyTorch forward hooks (the LoRA rows and layers);
- a method that is not a module's `forward` (a VAE's `decode`, a scheduler's `step`)
  is wrapped on its instance (`coordinator.wrap_method`), and the one class-level
  property (`execution_device.py`) is replaced for the length of a call only.

What is intercepted, and why (module):

1. The denoiser's and text encoders' `forward`, the VAE's `decode`, each request's
   scheduler copy's `step`: inside a coordinator task, the call is handed to the
   coordinator, which runs the waiting tasks' calls as one fused call. Why: step
   mode (a task per request) and waves of several sizes (a task per size) share one
   module call. (`coordinator.py`, `fusion.py`, `scheduler_fusion.py`)
2. The denoiser and text encoders (torch pre/post hooks): each call takes its rows,
   each row's LoRA stack, from the row plan the pipeline adapter states for the
   diffusers call. Why: per-sample adapters need each row's stack, and the layout is
   stated, never guessed from shapes. (`rows.py`)
3. Every PEFT LoRA `Linear` (torch forward hook): adds each row's adapters' deltas,
   gathered per row; PEFT's own application is off and its weight copy freed. Why:
   requests with different adapters share one forward. (`lora_mixing.py`)
4. The transformer's attention modules and patch embedding (`forward`, only during
   a packed call): attention and embedding per size group. Why: requests of
   different sizes share one transformer forward. (`packed_tokens.py`)
5. `DiffusionPipeline._execution_device`, for the length of a call: the device
   found at loading. Why: diffusers' lookup walks every module at every read.
   (`execution_device.py`)
6. The `guidance_scale` argument (a value, not a patch): a float to the pipeline,
   one scale per sample to the CFG combine. Why: requests with different guidance
   share one call. (`guidance.py`)
7. With `--compile`, the denoiser's (and VAE decoder's) `forward`, inside the fusion
   hook: a call runs padded to its wave-size bucket through a graph compiled from a
   hook-free twin of the module, and is cut back. Why: compiled forwards that keep
   batching without a recompile per wave size. (`compiled.py`)

Adding one: per-request step caching (`step_cache.py`) is one more `route_forward`
hook on the denoiser's blocks that reads `rows.current_rows()` (each row's request,
in a fused call too), keeps its cache state per request, and runs the remaining
blocks on the gathered rows that compute.
"""

from diffbatch.pipelines.interception.coordinator import Coordinator, Task, install, wrap_method
from diffbatch.pipelines.interception.execution_device import pin_execution_device, pinned_device
from diffbatch.pipelines.interception.fusion import (
    FusionPoint,
    ModuleCall,
    Unfusable,
    fuse_arguments,
    run_fused,
    split_result,
)
from diffbatch.pipelines.interception.guidance import PerSampleGuidance
from diffbatch.pipelines.interception.rows import CallRows, RowLayout, RowPlan, row_plan

__all__ = [
    "CallRows", "Coordinator", "FusionPoint", "ModuleCall", "PerSampleGuidance", "RowLayout",
    "RowPlan", "Task", "Unfusable", "fuse_arguments", "install", "pin_execution_device",
    "pinned_device", "row_plan", "run_fused", "split_result", "wrap_method",
]
