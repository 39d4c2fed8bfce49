"""Generated images kept for a while in memory, served as links: `response_format: "url"`.

OpenAI answers `response_format: "url"` (the official client's default for its older
models) with links that expire after 60 minutes. This store does the same for one
server process: each encoded image gets an unguessable id (192 random bits), is kept
in memory until it expires (`ttl_s`) or until newer images need its room (`max_bytes`,
oldest first), and is served by `GET /v1/images/files/{file_id}`.

NOTE: the links are capabilities, as OpenAI's signed links are: `GET /v1/images/files/`
needs no API key (an `<img src>` or a plain download cannot send one), and knowing an
id is what grants access. Ids are never logged. A restart forgets every image.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from diffbatch.errors import InvalidRequestError

FILES_ROUTE = "/v1/images/files"
DEFAULT_TTL_S = 3600.0  # OpenAI's links last 60 minutes
DEFAULT_MAX_MB = 256  # `--image-store-mb`: about 20,000 PNGs of 64x64, or 20 of 2048x2048
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass(frozen=True)
class StoredImage:
    """One image in the store."""

    data: bytes  # the encoded file
    media_type: str  # "image/png", ...
    expires_at: float  # the store's clock (monotonic seconds)


class ImageStoreFullError(InvalidRequestError):
    """One answer's images are larger than the whole store (a 400: the client can ask
    for base64 images, or fewer or smaller ones)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="response_format")


def max_file_bytes(width: int, height: int) -> int:
    """An upper bound on one encoded RGB image of `width` x `height` in any of the
    formats served (incompressible pixels stored nearly raw, plus headers)."""
    return int(3 * width * height * 1.1) + 4096


class ImageStore:
    """A bounded, expiring, thread-safe map from file id to image; see the module docstring.

    Args:
        max_bytes: Most bytes of images kept; the oldest go first to make room.
        ttl_s: Seconds an image stays reachable.
        clock: Monotonic seconds (injectable for tests).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_MB << 20, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._images: OrderedDict[str, StoredImage] = OrderedDict()  # oldest first
        self._num_bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, output_format: str) -> str:
        """Keep `data` (an encoded `output_format` image); returns its file id,
        "<random>.<format>"."""
        return self.put_all([data], output_format)[0]

    def put_all(self, files: list[bytes], output_format: str) -> list[str]:
        """Keep the images of one answer together (older images make room for them,
        never one of them for another); their file ids, in order."""
        total = sum(len(data) for data in files)
        if total > self.max_bytes:
            raise ImageStoreFullError(
                f"the {len(files)} image file(s) of this answer take {total} bytes, more "
                f"than this server's image store holds ({self.max_bytes} bytes); use "
                "\"b64_json\", or ask for fewer or smaller images"
            )
        ids = [f"{secrets.token_urlsafe(24)}.{output_format}" for _ in files]
        with self._lock:
            now = self._clock()
            self._drop_expired(now)
            while self._num_bytes + total > self.max_bytes:
                _, oldest = self._images.popitem(last=False)
                self._num_bytes -= len(oldest.data)
            for file_id, data in zip(ids, files, strict=True):
                self._images[file_id] = StoredImage(data, MEDIA_TYPES[output_format],
                                                    now + self.ttl_s)
            self._num_bytes += total
        return ids

    def get(self, file_id: str) -> StoredImage | None:
        """The image `file_id` names, or None when unknown, expired or evicted."""
        with self._lock:
            self._drop_expired(self._clock())
            return self._images.get(file_id)

    def seconds_left(self, image: StoredImage) -> float:
        return max(0.0, image.expires_at - self._clock())

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._num_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._images)

    def _drop_expired(self, now: float) -> None:
        # Insertion order is expiry order: every image lives the same ttl_s.
        while self._images:
            file_id, image = next(iter(self._images.items()))
            if image.expires_at > now:
                return
            del self._images[file_id]
            self._num_bytes -= len(image.data)
