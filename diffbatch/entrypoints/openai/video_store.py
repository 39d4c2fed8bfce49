"""Video jobs of `/v1/videos`: their state while they run, their clips once finished.

OpenAI's Videos API is asynchronous: `POST /v1/videos` answers at once with a job,
the client polls `GET /v1/videos/{id}` and downloads `GET /v1/videos/{id}/content`
once the job is `completed`. This store keeps the jobs of one server process:

- a job is `queued`, then `in_progress` (with `progress` from the denoising steps
  done) once its request runs, then `completed` (its MP4 kept) or `failed` (its error
  kept in OpenAI's shape);
- finished jobs are kept for `ttl_s` after they finish (`expires_at`), and their clips
  take at most `max_bytes` together: the oldest finished jobs go first to make room;
  at most `max_jobs` jobs are known at once (the oldest finished go first; when all
  are still running, a new one is refused with a 429);
- a deleted job is forgotten at once (its request, if running, is aborted by the
  caller: `OpenAIServingVideos.delete`).

All methods run on the server's event loop (the clip is encoded in a thread, then
handed to `complete` on the loop), so the store needs no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from diffbatch.errors import DiffbatchError

DEFAULT_TTL_S = 3600.0  # `--video-ttl-s`: finished clips stay downloadable an hour
DEFAULT_MAX_MB = 512  # `--video-store-mb`: memory for finished clips
DEFAULT_MAX_JOBS = 1000  # jobs known at once (queued, running and finished)

Status = Literal["queued", "in_progress", "completed", "failed"]


class TooManyJobsError(DiffbatchError):
    """Every job the store may know is still running; retry once one has finished."""

    status_code = 429
    type = "rate_limit_error"


@dataclass
class VideoJob:
    """One video job, as `GET /v1/videos/{id}` reports it (`to_json`)."""

    id: str
    prompt: str
    model: str
    seconds: str
    size: str  # "WxH"
    num_frames: int
    fps: int
    num_inference_steps: int
    created_at: int  # Unix seconds
    status: Status = "queued"
    progress: int = 0  # percent
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None  # {"code", "message", "param", "type"}
    content: bytes | None = field(default=None, repr=False)  # the MP4, once completed
    finished_at: float | None = None  # the store's clock, once finished

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `Video` object."""
        return {
            "id": self.id, "object": "video", "created_at": self.created_at,
            "status": self.status, "progress": self.progress, "model": self.model,
            "prompt": self.prompt, "seconds": self.seconds, "size": self.size,
            "completed_at": self.completed_at, "expires_at": self.expires_at,
            "error": self.error, "remixed_from_video_id": None,
        }


class VideoStore:
    """The jobs of one server; see the module docstring.

    Args:
        max_bytes: Most bytes of finished clips kept.
        ttl_s: Seconds a finished job (and its clip) stays reachable.
        max_jobs: Most jobs known at once.
        clock: Monotonic seconds (injectable for tests).
        wall_clock: Unix seconds, for `expires_at`.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_MB << 20, ttl_s: float = DEFAULT_TTL_S,
                 max_jobs: int = DEFAULT_MAX_JOBS,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.max_bytes, self.ttl_s, self.max_jobs = max_bytes, ttl_s, max_jobs
        self._clock, self._wall_clock = clock, wall_clock
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()  # oldest created first
        self._num_bytes = 0

    # -- reading -----------------------------------------------------------------------
    def get(self, job_id: str) -> VideoJob | None:
        """The job, unless unknown, deleted or expired."""
        self._expire()
        return self._jobs.get(job_id)

    def list(self, *, after: str | None, limit: int, order: Literal["asc", "desc"]
             ) -> tuple[list[VideoJob], bool]:
        """Up to `limit` jobs by creation time after job `after` (in `order`), and
        whether more follow."""
        self._expire()
        jobs = list(self._jobs.values())
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [job.id for job in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def count(self, status: Status) -> int:
        return sum(1 for job in self._jobs.values() if job.status == status)

    # -- writing -----------------------------------------------------------------------
    def add(self, job: VideoJob) -> None:
        """Keep a new job; the oldest finished jobs make room (429 if none is finished)."""
        self._expire()
        while len(self._jobs) >= self.max_jobs:
            oldest = next((j for j in self._jobs.values() if j.finished), None)
            if oldest is None:
                raise TooManyJobsError(
                    f"this server runs at most {self.max_jobs} video jobs at once; retry "
                    "when one has finished")
            self._remove(oldest.id)
        self._jobs[job.id] = job

    def complete(self, job_id: str, content: bytes) -> VideoJob | None:
        """Mark a job completed with its clip (None: it was deleted meanwhile). When the
        clip alone is larger than the store, the job fails instead."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if len(content) > self.max_bytes:
            return self.fail(job_id, {
                "code": "video_too_large", "type": "invalid_request_error", "param": None,
                "message": f"the clip is {len(content)} bytes, more than this server keeps "
                           f"({self.max_bytes}, --video-store-mb); ask for fewer frames or "
                           "a smaller size"})
        while self._num_bytes + len(content) > self.max_bytes:
            oldest = next(j for j in self._jobs.values() if j.content is not None)
            self._remove(oldest.id)
        job.content = content
        self._num_bytes += len(content)
        self._finish(job, "completed")
        job.progress = 100
        return job

    def fail(self, job_id: str, error: dict[str, Any]) -> VideoJob | None:
        """Mark a job failed with `error` (None: it was deleted meanwhile)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        job.error = error
        self._finish(job, "failed")
        return job

    def delete(self, job_id: str) -> VideoJob | None:
        """Forget a job (and its clip); the job, or None if it was unknown."""
        self._expire()
        return self._remove(job_id)

    # -- internals ---------------------------------------------------------------------
    def _finish(self, job: VideoJob, status: Status) -> None:
        job.status = status
        now = self._wall_clock()
        job.completed_at = int(now)
        job.expires_at = int(now + self.ttl_s)
        job.finished_at = self._clock()

    def _remove(self, job_id: str) -> VideoJob | None:
        job = self._jobs.pop(job_id, None)
        if job is not None and job.content is not None:
            self._num_bytes -= len(job.content)
        return job

    def _expire(self) -> None:
        now = self._clock()
        for job in [j for j in self._jobs.values() if j.finished_at is not None
                    and now - j.finished_at >= self.ttl_s]:
            self._remove(job.id)
