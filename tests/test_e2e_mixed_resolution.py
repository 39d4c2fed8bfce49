"""`--mixed-resolution` end to end: the flag reaches the engine's keys and the waves.

With the flag, a transformer model's requests of different sizes share a wave; a
UNet model's still split by size (its convolutions would see the padding).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.config import EngineConfig, add_cli_args

SIZES = [64, 64, 96, 96]


def engine_from_flags(model: str, *flags: str, max_num_seqs: int = 8) -> Engine:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        *flags, "--max-num-seqs", str(max_num_seqs), "--request-batch-max-wait-ms", "500",
        "--executor", "inproc", "--torch-threads", "1", "--calibration-budget-s", "0",
        "--no-warmup"])
    return Engine.from_config(dataclasses.replace(EngineConfig.from_cli_args(args),
                                                  model=model))


def wave_sizes(engine: Engine, sizes: list[int] = SIZES) -> list[int]:
    params = [SamplingParams(height=s, width=s, num_inference_steps=2, seed=i)
              for i, s in enumerate(sizes)]
    outputs = engine.generate([f"prompt {i}" for i in range(len(sizes))], params,
                              use_tqdm=False)
    assert all(o.ok for o in outputs), [o.error for o in outputs]
    assert [o.images[0].size for o in outputs] == [(s, s) for s in sizes]
    return [o.batch_size for o in outputs]


@pytest.mark.parametrize(("model", "flag", "expected"), [
    ("tiny-sd3", "--mixed-resolution", [4, 4, 4, 4]),  # one wave: 6.5 of 8 units
    ("tiny-sd3", "--no-mixed-resolution", [2, 2, 2, 2]),  # one wave per size
    ("tiny-sd", "--mixed-resolution", [2, 2, 2, 2]),  # a UNet keeps size in the key
    ("tiny-pixart", "--mixed-resolution --step-execution", [4, 4, 4, 4]),  # one batch
])
def test_the_flag_lets_transformer_waves_mix_sizes_and_unets_split_by_size(
        model: str, flag: str, expected: list[int]) -> None:
    with engine_from_flags(model, *flag.split()) as engine:
        assert engine.config.mixed_resolution == flag.startswith("--mixed-resolution")
        assert wave_sizes(engine) == expected


def test_step_mode_counts_the_running_batch_in_pixels_at_the_default_size():
    """Capacity 4 on a 64x64 model: a 128x128 request fills the running batch (4
    units), so the 64x64 requests join only once it left, all four together; counted
    in requests, three of them would have joined it."""
    flags = ("--mixed-resolution", "--step-execution")
    with engine_from_flags("tiny-sd3", *flags, max_num_seqs=4) as engine:
        assert wave_sizes(engine, [128, 64, 64, 64, 64]) == [1, 4, 4, 4, 4]
