"""diffbatch: a serving engine for diffusion models built around request-level batching."""

from diffbatch.sampling_params import SamplingParams, SamplingParamsKey

__all__ = ["SamplingParams", "SamplingParamsKey"]
__version__ = "0.1.0"
