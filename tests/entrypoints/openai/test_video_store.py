"""The video job store: expiry of finished jobs, its memory bound, its job bound."""

from __future__ import annotations

import pytest

from diffbatch.entrypoints.openai.video_store import TooManyJobsError, VideoJob, VideoStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def job(job_id: str) -> VideoJob:
    return VideoJob(id=job_id, prompt="p", model="m", seconds="1", size="32x32",
                    num_frames=9, fps=16, num_inference_steps=4, created_at=0)


def test_a_finished_job_expires_after_its_ttl_and_a_running_one_never() -> None:
    clock = Clock()
    store = VideoStore(max_bytes=1000, ttl_s=60, clock=clock, wall_clock=clock)
    store.add(job("a"))
    store.add(job("b"))
    done = store.complete("a", b"x" * 10)
    assert done is not None and done.status == "completed"
    assert done.expires_at == int(clock.now + 60)
    clock.now += 59
    assert store.get("a") is not None
    clock.now += 1
    assert store.get("a") is None and store.num_bytes == 0  # expired, its clip freed
    clock.now += 10_000
    assert store.get("b") is not None and store.get("b").status == "queued"


def test_clips_beyond_the_memory_bound_push_out_the_oldest() -> None:
    store = VideoStore(max_bytes=100)
    for name in "abc":
        store.add(job(name))
    store.complete("a", b"x" * 60)
    store.complete("b", b"x" * 60)  # a goes
    assert store.get("a") is None and store.get("b").content is not None
    assert store.num_bytes == 60
    failed = store.complete("c", b"x" * 101)  # larger than the whole store
    assert failed.status == "failed" and failed.error["code"] == "video_too_large"
    assert store.get("b") is not None


def test_the_job_bound_drops_finished_jobs_then_refuses() -> None:
    store = VideoStore(max_jobs=2)
    store.add(job("a"))
    store.add(job("b"))
    store.fail("a", {"code": "x", "message": "y"})
    store.add(job("c"))  # a (finished) makes room
    assert store.get("a") is None
    with pytest.raises(TooManyJobsError) as exc:
        store.add(job("d"))  # b and c still run
    assert exc.value.status_code == 429


def test_list_pages_by_creation_order() -> None:
    store = VideoStore()
    for name in "abcd":
        store.add(job(name))
    page, more = store.list(after=None, limit=3, order="desc")
    assert [j.id for j in page] == ["d", "c", "b"] and more
    page, more = store.list(after="b", limit=3, order="desc")
    assert [j.id for j in page] == ["a"] and not more
    page, _ = store.list(after=None, limit=2, order="asc")
    assert [j.id for j in page] == ["a", "b"]
