"""Tests for diffbatch.ipc.shm: what goes to shared memory, round trips, segment lifetime."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

from diffbatch.ipc import shm
from diffbatch.ipc.messages import recv_message, send_message
from diffbatch.ipc.shm import ShmTensorHandle
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput

REPO_ROOT = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs a listable /dev/shm")

Pair = namedtuple("Pair", ["left", "right"])


def segment_exists(handle: ShmTensorHandle) -> bool:
    return (SHM_DIR / handle.name).exists()


def own_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(shm.segment_prefix())}


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = own_segments()
    yield
    assert own_segments() == before, "a test left shared memory segments behind"


def test_at_threshold_stays_inline_above_goes_to_shm():
    at = torch.zeros(256, dtype=torch.float32)  # exactly 1024 bytes
    above = torch.zeros(257, dtype=torch.float32)
    inline = shm.pack(at, threshold_bytes=1024)
    assert isinstance(inline, shm.InlineTensor) and inline.data == at.numpy().tobytes()
    assert torch.equal(shm.unpack(inline), at)
    packed = shm.pack(above, threshold_bytes=1024)
    assert isinstance(packed, ShmTensorHandle)
    assert packed.nbytes == 257 * 4 and packed.shape == (257,)
    assert packed.name.startswith(shm.segment_prefix())
    assert segment_exists(packed)
    out = shm.unpack(packed)
    assert not segment_exists(packed)
    assert torch.equal(out, above)


def test_default_threshold_is_one_mib():
    small = torch.zeros(1 << 18, dtype=torch.float32)  # 1 MiB exactly
    image = torch.rand(1, 3, 512, 512)  # 3 MiB
    assert isinstance(shm.pack(small), shm.InlineTensor)
    packed = shm.pack(image)
    assert isinstance(packed, ShmTensorHandle)
    assert torch.equal(shm.unpack(packed), image)


def test_nested_batch_runner_output_packs_every_tensor_without_mutating_input():
    images = {rid: torch.rand(2, 3, 16, 16) for rid in ("a", "b")}
    extras = [torch.arange(10), (torch.ones(4, dtype=torch.float16), "text")]
    result = BatchRunnerOutput(
        outputs={
            rid: DiffusionOutput(rid, images=img, metadata={"extras": extras, "pair": Pair(
                torch.full((3,), 7), 1.5)})
            for rid, img in images.items()
        },
        forward_time_ms=12.5,
    )
    packed = shm.pack(result, threshold_bytes=0)
    # The input still holds its tensors; the packed copy holds handles only.
    assert result.outputs["a"].images is images["a"]
    assert isinstance(result.outputs["a"].metadata["extras"][0], torch.Tensor)
    assert isinstance(packed, BatchRunnerOutput) and packed.req_ids == ["a", "b"]
    found = shm.handles(packed)
    assert len(found) == 2 * 4  # images, arange, ones, full per request
    assert all(segment_exists(h) for h in found)
    assert isinstance(packed.outputs["b"].metadata["pair"], Pair)
    assert isinstance(packed.outputs["b"].metadata["extras"][1], tuple)

    out = shm.unpack(packed)
    assert not any(segment_exists(h) for h in found)
    assert out.forward_time_ms == 12.5
    for rid, img in images.items():
        assert torch.equal(out.outputs[rid].images, img)
        meta = out.outputs[rid].metadata
        assert torch.equal(meta["extras"][0], extras[0])
        assert meta["extras"][1][1] == "text" and meta["extras"][1][0].dtype == torch.float16
        assert isinstance(meta["pair"], Pair)
        assert torch.equal(meta["pair"].left, torch.full((3,), 7))


def test_structure_without_tensors_is_returned_as_is():
    result = BatchRunnerOutput(outputs={"a": DiffusionOutput("a", images=[1, 2])})
    assert shm.pack(result) is result


def test_small_tensors_travel_as_bytes_and_round_trip_exactly():
    """Small tensors skip torch's slow storage pickling (see InlineTensor's NOTE)."""
    import pickle

    images = torch.randint(0, 255, (8, 64, 64, 3), dtype=torch.uint8)
    strided = torch.rand(4, 6)[:, ::2]  # non-contiguous
    result = BatchRunnerOutput(outputs={"a": DiffusionOutput("a", images=images),
                                        "b": DiffusionOutput("b", images=strided),
                                        "c": DiffusionOutput("c", images=torch.zeros(0, 3))})
    packed = shm.pack(result)
    assert isinstance(packed.outputs["a"].images, shm.InlineTensor)
    out = shm.unpack(pickle.loads(pickle.dumps(packed)))
    assert torch.equal(out.outputs["a"].images, images)
    assert torch.equal(out.outputs["b"].images, strided)
    assert out.outputs["c"].images.shape == (0, 3)
    assert result.outputs["a"].images is images  # the input is not mutated


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int8,
     torch.uint8, torch.bool, torch.complex64],
)
def test_dtype_round_trip(dtype):
    tensor = (torch.randn(3, 5, 7) * 100).to(dtype)
    packed = shm.pack(tensor, threshold_bytes=0)
    assert packed.dtype == str(dtype)
    out = shm.unpack(packed)
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.rand(4, 6, 8).transpose(0, 2),
        lambda: torch.rand(10, 10)[::3, 1::2],
        lambda: torch.rand(1, 5).expand(4, 5),
        lambda: torch.rand(3, 4, dtype=torch.bfloat16).t(),
        lambda: torch.randn(4, dtype=torch.complex64).conj(),
    ],
    ids=["transpose", "strided-slice", "expand", "bf16-transpose", "conj"],
)
def test_non_contiguous_round_trip(make):
    tensor = make()
    out = shm.unpack(shm.pack(tensor, threshold_bytes=0))
    assert out.is_contiguous() and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def test_zero_dim_and_empty_tensors():
    scalar = torch.tensor(3.25, dtype=torch.bfloat16)
    empty = torch.empty(0, 3, 8)
    packed = shm.pack({"scalar": scalar, "empty": empty}, threshold_bytes=0)
    assert isinstance(packed["scalar"], ShmTensorHandle) and packed["scalar"].shape == ()
    assert isinstance(packed["empty"], shm.InlineTensor)  # 0 bytes never exceed a threshold
    out = shm.unpack(packed)
    assert out["scalar"].shape == () and out["scalar"].item() == 3.25
    assert out["scalar"].dtype == torch.bfloat16
    assert out["empty"].shape == (0, 3, 8)


def test_numpy_arrays_round_trip():
    arrays = [np.random.rand(20, 30).astype(np.float32)[:, ::3], np.array(5, dtype=np.int16),
              np.arange(12, dtype=">i4").reshape(3, 4)]
    packed = shm.pack(arrays, threshold_bytes=0)
    assert all(isinstance(h, ShmTensorHandle) and h.kind == "numpy" for h in packed)
    out = shm.unpack(packed)
    for got, want in zip(out, arrays, strict=True):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        assert got.shape == want.shape and np.array_equal(got, want)


def test_release_unlinks_without_reading():
    packed = shm.pack([torch.rand(100), torch.rand(200)], threshold_bytes=0)
    found = shm.handles(packed)
    assert all(segment_exists(h) for h in found)
    assert shm.release(packed) == 2
    assert not any(segment_exists(h) for h in found)
    assert shm.release(packed) == 0  # already gone: no error


def test_unpack_with_a_missing_segment_still_unlinks_the_others():
    packed = shm.pack([torch.rand(100), torch.rand(200)], threshold_bytes=0)
    shm.release(packed[0])
    with pytest.raises(FileNotFoundError):
        shm.unpack(packed)
    assert not segment_exists(packed[1])


def test_sweep_only_touches_the_given_prefix():
    packed = shm.pack(torch.rand(64), threshold_bytes=0)
    assert shm.sweep(shm.segment_prefix(os.getpid() + 1_000_000)) == 0
    assert shm.sweep("not_ours_") == 0
    assert segment_exists(packed)
    assert shm.sweep(shm.segment_prefix()) == 1
    assert not segment_exists(packed)


def test_full_shared_memory_keeps_the_tensor_inline(monkeypatch, caplog):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "pwrite", no_space)
    monkeypatch.setattr(shm, "_warned_full", False)
    tensor = torch.rand(1000)
    with caplog.at_level(logging.WARNING, logger=shm.__name__):
        packed = shm.pack({"images": tensor}, threshold_bytes=0)
    assert packed["images"] is tensor  # sent inline (pickled) instead of failing
    assert "shared memory is full" in caplog.text
    # (the autouse fixture checks that the half-made segment was unlinked)


def test_messages_keep_small_tensors_inline_in_the_pickle():
    # Connection.send would hand every tensor to torch's fd-sharing reducer (a fresh
    # shm file plus a "resource sharer" thread); send_message pickles plainly.
    small = torch.arange(16, dtype=torch.float16)
    reader, writer = multiprocessing.Pipe(duplex=False)
    threads_before = {t.name for t in threading.enumerate()}
    send_message(writer, {"images": small})
    got = recv_message(reader)["images"]
    assert torch.equal(got, small) and got.dtype == torch.float16
    assert {t.name for t in threading.enumerate()} == threads_before
    reader.close()
    writer.close()


# --- across processes --------------------------------------------------------------
# A spawned child packs; this (or a helper) process unpacks, releases or sweeps. Run
# in a fresh interpreter so the resource tracker's exit-time warnings can be captured.


def _sample() -> dict[str, torch.Tensor]:
    return {"bf16": torch.arange(600_000, dtype=torch.float32).to(torch.bfloat16),
            "image": torch.arange(3 * 64 * 64, dtype=torch.float32).reshape(1, 3, 64, 64)}


def _child_pack(conn) -> None:
    """Pack three results (to be unpacked, released, and never read), then die."""
    for mode in ("unpack", "release", "die"):
        send_message(conn, (mode, os.getpid(), shm.pack(_sample(), threshold_bytes=1024)))
    recv_message(conn)
    os._exit(3)  # as if the worker died with the third reply unread


def _independent_producer() -> None:
    """Pack in a separate interpreter (its own resource tracker) and exit at once."""
    print(pickle.dumps(shm.pack(_sample(), threshold_bytes=1024)).hex())


def _report(packed, ok: bool, existed: bool) -> dict:
    found = shm.handles(packed)
    left = [h.name for h in found if (SHM_DIR / h.name).exists()]
    return {"handles": len(found), "existed": existed, "ok": ok, "left": left}


def _matches_sample(out) -> bool:
    want = _sample()
    return all(torch.equal(out[k], want[k]) and out[k].dtype == want[k].dtype for k in want)


def _cross_process_main() -> None:
    report = {}
    # A producer whose resource tracker is not ours and that exits before we read:
    # its tracker must not unlink (or warn about) the segments it handed over.
    proc = subprocess.run(
        [sys.executable, "-c",
         "from tests.ipc.test_shm import _independent_producer; _independent_producer()"],
        capture_output=True, text=True, check=True,
    )
    sys.stderr.write(proc.stderr)
    packed = pickle.loads(bytes.fromhex(proc.stdout.strip().splitlines()[-1]))
    existed = all((SHM_DIR / h.name).exists() for h in shm.handles(packed))
    report["exited"] = _report(packed, _matches_sample(shm.unpack(packed)), existed)

    # A spawned child (sharing our resource tracker, like the worker).
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child_pack, args=(child_conn,), daemon=True)
    child.start()
    for _ in range(3):
        mode, pid, packed = recv_message(parent_conn)
        existed = all((SHM_DIR / h.name).exists() for h in shm.handles(packed))
        if mode == "unpack":
            ok = _matches_sample(shm.unpack(packed))
        elif mode == "release":
            ok = shm.release(packed) == 2
        else:
            send_message(parent_conn, "go")
            child.join()
            ok = child.exitcode == 3 and shm.sweep(shm.segment_prefix(pid)) == 2
        report[mode] = _report(packed, ok, existed)
    print(json.dumps(report))


@pytest.mark.slow
def test_cross_process_round_trip_release_and_sweep_leave_nothing():
    proc = subprocess.run(
        [sys.executable, "-c",
         "from tests.ipc.test_shm import _cross_process_main; _cross_process_main()"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(report) == ["die", "exited", "release", "unpack"]
    for mode, result in report.items():
        assert result == {"handles": 2, "existed": True, "ok": True, "left": []}, mode
    # The resource tracker complains at exit about segments it thinks leaked, and
    # prints a traceback if an unregister comes after the matching unlink.
    assert "leaked shared_memory" not in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
