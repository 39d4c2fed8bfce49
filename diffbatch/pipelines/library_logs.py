"""What diffusers and transformers log, made fit for a server's log.

- `TorchvisionFallbackFilter` drops a start-up notice that says nothing here;
- `TruncatedPromptFilter` keeps users' prompts out of the log: the pipelines warn, at
  WARNING and for every such request, with the part of a prompt the text encoder cut
  off. The warning stays (a prompt was cut), without the text: prompts are logged at
  DEBUG at most (docs/serving.md);
- huggingface_hub prints through a handler of its own and also passes each record on
  to the root logger, so a configured root printed every hub warning twice: its
  records stop at its own handler.

`install()` does all three, once per process.
"""

from __future__ import annotations

import logging
import re


class TorchvisionFallbackFilter(logging.Filter):
    """Drops transformers' notice that an `<Model>ImageProcessor` falls back to its PIL
    twin because torchvision is not installed, and nothing else.

    NOTE: diffusers' StableDiffusion pipeline module and its IP-adapter loader import
    `CLIPImageProcessor` and `SiglipImageProcessor` at import time, so every engine start
    printed two such warnings, whatever the model folder holds. torchvision is left out
    on purpose, and diffbatch runs no image processor (no safety checker, no IP adapter:
    those components are loaded as None), so the fallback changes nothing here.
    """

    LOGGER = "transformers.utils.import_utils"
    _PATTERN = re.compile(
        r"`\w+ImageProcessor` requires torchvision \(not installed\); "
        r"falling back to `\w+ImageProcessorPil`"
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._PATTERN.match(record.getMessage())

    @classmethod
    def install(cls) -> None:
        """Add the filter to transformers' import logger, once per process."""
        target = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in target.filters):
            target.addFilter(cls())


class TruncatedPromptFilter(logging.Filter):
    """Replaces the cut-off prompt text in the pipelines' truncation warnings (CLIP's
    77 tokens, T5's `max_sequence_length`) by a note; other records pass unchanged."""

    PREFIX = "The following part of your input was truncated because"

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.PREFIX):
            reason = record.getMessage()[len(self.PREFIX):].split(":", 1)[0].strip()
            record.msg = "a prompt was truncated because %s (the cut text is not logged)"
            record.args = (reason,)
        return True


def install() -> None:
    """Add the filters, once per process: the torchvision one on transformers' import
    logger; the prompt one on every handler of diffusers' and transformers' library
    loggers (their records do not propagate past them) and on the root logger's, for
    a configuration that lets them propagate."""
    import diffusers.utils.logging
    import transformers.utils.logging

    TorchvisionFallbackFilter.install()
    logging.getLogger("huggingface_hub").propagate = False
    libraries = [diffusers.utils.logging.get_logger("diffusers"),
                 transformers.utils.logging.get_logger("transformers"), logging.getLogger()]
    for logger in libraries:
        for handler in logger.handlers:
            if not any(isinstance(f, TruncatedPromptFilter) for f in handler.filters):
                handler.addFilter(TruncatedPromptFilter())
