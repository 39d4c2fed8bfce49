"""The worker's malloc tuning: a repeated large allocation stops costing page faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from diffbatch.worker import malloc

# In a fresh process: tune (or not), then allocate, touch and free 8 MiB blocks of
# varying sizes, as a forward does with its activations; print the minor page faults
# of the last 20 rounds.
_PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from diffbatch.worker.malloc import tune_malloc
    print(tune_malloc())
    def rounds(n):
        for i in range(n):
            blocks = [torch.ones((2 << 20) + 4096 * (i % 7 + j)) for j in range(6)]
            del blocks
    rounds(5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rounds(20)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def run_probe(env: dict[str, str] | None = None) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    tuned, faults = done.stdout.split()
    return tuned, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_process_reuses_its_heap_for_repeated_large_blocks():
    tuned, faults = run_probe()
    assert tuned == "True"
    # 20 rounds x 6 blocks of ~8 MiB: fresh pages each time would be ~2,000 faults per
    # block (240,000 in all); reused heap memory needs none.
    assert faults < 2000


def test_a_users_own_malloc_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert malloc.tune_malloc() is False
