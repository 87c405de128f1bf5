"""One way to replace a file atomically (readers see the old bytes or the new, never a part), and
one way to hold a lock file across processes (builds that share a cache)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
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


@contextlib.contextmanager
def exclusive_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `path` (created, with its directory, if missing) for the block:
    one process at a time builds or removes what the lock guards; released when the block ends or
    the process dies. Yields whether it is held: always with `wait`; without, False at once when
    another process holds it (a prune skips what a build is using)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
