"""One way to replace a file atomically: readers see the old bytes or the new, never a part."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(
    path: Path,
    data: bytes | str,
    mode: int,
    *,
    sync: bool = False,
    owner: tuple[int, int] | None = None,
) -> None:
    """Write `data` beside `path` under a name unique to this process and thread (concurrent
    writers never share a temp file), give it exactly `mode` (whatever the umask) and `owner`
    (uid, gid) when given, then rename it over `path`: a reader sees the old file or the whole
    new one, never a partial or wrongly owned one. `sync`: flushed to disk before the rename
    (state that must survive a crash). Raises OSError; the callers say which file and why."""
    raw = data.encode() if isinstance(data, str) else data
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temp.unlink(missing_ok=True)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            if owner is not None:
                os.fchown(handle.fileno(), *owner)
            handle.write(raw)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
