"""diffbatch: a serving engine for diffusion models built around request-level batching.

    from diffbatch import Engine, SamplingParams
    with Engine("tiny-sd", max_num_seqs=4, request_batch_max_wait_ms=20) as engine:
        outs = engine.generate(["a cat", "a dog"], SamplingParams(seed=7))
"""

from diffbatch.config import EngineConfig
from diffbatch.engine.async_engine import Engine
from diffbatch.errors import (
    ConfigError,
    DiffbatchError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    PayloadTooLargeError,
    PipelineError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput, PartialImage, RequestError
from diffbatch.pipelines.interface import BasePipeline, DiffusionRequestBatch, PipelineInfo
from diffbatch.request import DiffusionRequest, RequestStatus
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
from diffbatch.sched.output import SchedulerOutput

__version__ = "0.1.0"

__all__ = [
    "BasePipeline",
    "BatchRunnerOutput",
    "ConfigError",
    "DiffbatchError",
    "DiffusionOutput",
    "DiffusionRequest",
    "DiffusionRequestBatch",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PartialImage",
    "PayloadTooLargeError",
    "PipelineError",
    "PipelineInfo",
    "QueueFullError",
    "RequestAbortedError",
    "RequestError",
    "RequestStatus",
    "RequestTimeoutError",
    "SamplingParams",
    "SamplingParamsKey",
    "SchedulerOutput",
    "__version__",
]
