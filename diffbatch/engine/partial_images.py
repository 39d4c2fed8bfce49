"""Routes partial images from the executor to the streams of the requests that asked.

The executor hands each partial image to `PartialImageRouter.deliver` from the thread
that received it (a worker's reader thread, or the engine loop in process), while the
wave still runs and before the wave's outputs. The router passes it to the sink its
request's stream opened (`Engine.generate_stream`), converted to the request's output
type, at most once per (image, partial_image_index): a wave the worker died under is
re-run on the replacement, and a failed wave's requests are re-run in halves (bisect
isolation), so the same preview can be made twice. A preview of a request whose
stream is closed (finished, aborted, never opened) is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from diffbatch.outputs import PartialImage, finalize_images

logger = logging.getLogger(__name__)


@dataclass
class _Sink:
    """One open stream: where its request's previews go, and which it has had."""

    output_type: str  # the request's `output_type`, for the conversion
    send: Callable[[PartialImage], None]  # must not block: called on the executor's thread
    sent: set[tuple[int, int]] = field(default_factory=set)  # (image_index, index) handed out


class PartialImageRouter:
    """Request id -> its stream's sink; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}

    def open(self, request_id: str, output_type: str,
             send: Callable[[PartialImage], None]) -> None:
        """Start handing `request_id`'s partial images to `send` (before it is queued)."""
        with self._lock:
            self._sinks[request_id] = _Sink(output_type, send)

    def close(self, request_id: str) -> None:
        """Stop; later previews of the request are dropped. Idempotent."""
        with self._lock:
            self._sinks.pop(request_id, None)

    def deliver(self, partial: PartialImage) -> bool:
        """Hand `partial` to its request's stream; False if dropped (see the module doc)."""
        with self._lock:
            sink = self._sinks.get(partial.request_id)
            seen = (partial.image_index, partial.index)
            if sink is None or seen in sink.sent:
                return False
            sink.sent.add(seen)
        import torch

        try:
            if isinstance(partial.image, torch.Tensor):  # as the runner shipped it
                partial.image = finalize_images(partial.image.unsqueeze(0),
                                                sink.output_type)[0]
        except Exception as exc:  # a malformed preview is dropped, the request goes on
            logger.warning("dropping a partial image of request %s: %s", partial.request_id,
                           exc)
            return False
        sink.send(partial)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._sinks)
