"""Which adapter a resolved request names: the client's name, its path, and its version.

The engine resolves each adapter a request names (`LoraRegistry.resolve`) into one
`LoraRef`, which crosses to the worker as a string (`key`) inside the request's
`lora`. The worker keeps resident adapters by that key, so an adapter whose file
changed (a new `stamp`) is a new adapter to it, never the old weights under an old
path; and every error it raises names `name`, the client's own word, never `path`.

A stamp is either the digest the worker computed when it validated the file
(`sha256:<hex>`: adapters loaded by name; the worker refuses a file whose digest
differs later), or the file's stat signature (`stat:<...>`: adapters found in
`--lora-dir` or given by path, read and validated at first use), or empty (a path
given straight to a worker, in tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

_PREFIX = "lora-ref:"


@dataclass(frozen=True)
class LoraRef:
    """One version of one adapter, as the worker loads it."""

    name: str  # what the client called it (a served name, a --lora-dir entry, a path)
    path: str  # the real path on the server; never shown to a client
    stamp: str = ""  # "sha256:<hex>", "stat:<size>-<mtime_ns>-<ino>" or "" (see above)

    @property
    def key(self) -> str:
        """The string form that crosses to the worker in `SamplingParams.lora`."""
        return _PREFIX + json.dumps([self.name, self.path, self.stamp])

    @classmethod
    def parse(cls, value: str) -> LoraRef:
        """The ref a `key` encodes; any other string is a path given as is."""
        if value.startswith(_PREFIX):
            name, path, stamp = json.loads(value[len(_PREFIX):])
            return cls(name, path, stamp)
        return cls(os.path.basename(os.path.normpath(value)) or "adapter", value)


def stat_stamp(path: str) -> str:
    """The stat signature of an adapter file, or of the newest entry of its folder: it
    changes when the file is replaced or rewritten."""
    try:
        st = os.stat(path)
        parts = [(st.st_size, st.st_mtime_ns, st.st_ino)]
        if os.path.isdir(path):
            for entry in os.scandir(path):
                if entry.name.endswith((".safetensors", ".bin")):
                    s = entry.stat()
                    parts.append((s.st_size, s.st_mtime_ns, s.st_ino))
    except (OSError, ValueError):
        return "stat:unreadable"
    return "stat:" + "-".join(f"{a}.{b}.{c}" for a, b, c in sorted(parts))
