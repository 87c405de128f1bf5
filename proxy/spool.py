"""The traffic-log spool: append-only JSON-lines segment files, fsynced, shipped in batches.

A writer thread appends records to `segment-<n>.jsonl` in groups: what arrives within one flush
interval (50 ms) is written and fsynced at once (group commit: one fsync per interval under load, not
one per record; a record is durable within about one interval of its decision, and a clean shutdown
writes every queued record). Segments rotate at a size
limit. The shipper reads records after a persisted cursor and POSTs them as
`{"records": [...]}` (`umbra.contracts.traffic`) to `{console}/api/v1/traffic/batches`; only a
2xx advances the cursor, so a
Console that is down, or a proxy that restarts, loses nothing (records carry ids: the Console
de-duplicates a batch it sees twice). Fully shipped segments other than the current one are deleted.

A line that can never be sent (not JSON, or JSON holding a lone-surrogate escape such as `\\udcff`,
which no UTF-8 request body can carry) is moved aside rather than retried: it is appended with its
segment, offset and fault to `quarantine.ndjson` in the spool directory, a warning is logged, and
shipping continues after it. Before this, one such line stopped shipping for good (issue #27).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from collections import deque
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

import httpx

from umbra.contracts.files import write_atomic
from umbra.contracts.traffic import TrafficBatch, TrafficRecord

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 8 << 20
FLUSH_INTERVAL = 0.05
_CURSOR = "cursor.json"
QUARANTINE = "quarantine.ndjson"  # not *.jsonl: never read back as a segment
# A `\uD800`-`\uDFFF` escape: the cheap pre-check before the exact one (it also matches an
# escaped backslash followed by such text, which the exact check then lets through).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class Fault(StrEnum):
    CORRUPT = "corrupt"  # not JSON
    LONE_SURROGATE = "lone_surrogate"  # JSON, but not encodable as UTF-8


def _fault(line: bytes) -> tuple[object, Fault | None]:
    """The parsed line, or why it can never be shipped."""
    try:
        record: object = json.loads(line)
    except ValueError:
        return None, Fault.CORRUPT
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(record, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return None, Fault.LONE_SURROGATE
    return record, None


def _segment_number(path: Path) -> int:
    return int(path.stem.removeprefix("segment-"))


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("segment-*.jsonl"), key=_segment_number)


class Spool:
    """Group commit: `append` only queues (the event loop never waits for the disk); the writer
    thread gathers what arrives within `flush_interval` of the first record of a group, then writes
    it with one `write` and one `fsync`. Under load that is one fsync per interval instead of one per
    record, and a record is on disk within about one interval of its decision. `flush` and `close`
    cut the wait short; `close` writes every queued record before it returns."""

    def __init__(
        self,
        directory: Path,
        segment_bytes: int = SEGMENT_BYTES,
        flush_interval: float = FLUSH_INTERVAL,
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._segment_bytes = segment_bytes
        self._interval = flush_interval
        existing = segments(directory)
        # Never append to a segment a crash may have cut mid-line: always start a fresh one.
        self._number = _segment_number(existing[-1]) + 1 if existing else 1
        self._file = self._open()
        # deque.append/popleft are atomic: no lock on the event loop's path.
        self._queue: deque[TrafficRecord] = deque()
        self._wake = threading.Event()  # something is queued (or closing)
        self._hurry = threading.Event()  # a flush or close is waiting: skip the group wait
        self._closing = False
        self._written = threading.Condition()
        self._appended = 0
        self._done = 0  # records taken off the queue and written (or dropped as unserializable)
        self.commits = 0  # fsynced groups, for tests and benchmarks
        self._thread = threading.Thread(target=self._run, name="umbra-spool", daemon=True)
        self._thread.start()

    def _open(self) -> int:
        path = self.directory / f"segment-{self._number:08d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return fd

    def append(self, record: TrafficRecord) -> None:
        """Queue a record (built with `TrafficRecord.build`) for disk."""
        if self._closing:
            # Fail closed rather than drop silently: nothing may be logged after close.
            raise RuntimeError("traffic spool is closed")
        self._appended += 1  # appends come from the event loop thread only
        self._queue.append(record)
        if not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every record appended so far is on disk."""
        target = self._appended
        self._hurry.set()
        self._wake.set()
        with self._written:
            self._written.wait_for(lambda: self._done >= target, timeout=timeout)

    def close(self) -> None:
        """Write every queued record, then stop the writer and close the segment."""
        self._closing = True
        self._hurry.set()
        self._wake.set()
        self._thread.join(timeout=10)
        os.close(self._file)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if not self._closing:
                # The group: whatever else arrives within one interval (a flush or close ends
                # the wait at once).
                self._hurry.wait(self._interval)
            self._hurry.clear()
            self._wake.clear()  # before draining: a later append sets it again
            closing = self._closing
            records: list[TrafficRecord] = []
            while self._queue:
                records.append(self._queue.popleft())
            if records:
                self._write(records)
            if closing and not self._queue:
                return

    def _write(self, records: list[TrafficRecord]) -> None:
        lines = []
        for record in records:
            try:
                lines.append(record.model_dump_json(by_alias=False).encode() + b"\n")
            except ValueError:  # not built with `build`; must not end the writer thread
                logger.exception("traffic record %s cannot be serialized; dropped", record.id)
        data = b"".join(lines)
        try:
            os.write(self._file, data)
            os.fsync(self._file)
            self.commits += 1
            if os.fstat(self._file).st_size >= self._segment_bytes:
                os.close(self._file)
                self._number += 1
                self._file = self._open()
        except OSError:
            logger.exception("traffic spool write failed")
        with self._written:
            self._done += len(records)
            self._written.notify_all()


class Shipper:
    """Ships spooled records to the Console in order; a non-2xx answer means 'retry later'."""

    def __init__(
        self,
        directory: Path,
        console_url: str,
        *,
        batch_size: int = 500,
        interval: float = 1.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.directory = directory
        self.url = console_url.rstrip("/") + "/api/v1/traffic/batches"
        self.batch_size = batch_size
        self.interval = interval
        self._client = client or httpx.AsyncClient(timeout=10)
        self.shipped = 0
        self.quarantined = 0

    def _cursor(self) -> tuple[int, int]:
        try:
            data = json.loads((self.directory / _CURSOR).read_text())
            return int(data["segment"]), int(data["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0

    def _save_cursor(self, segment: int, offset: int) -> None:
        cursor = json.dumps({"segment": segment, "offset": offset})
        write_atomic(self.directory / _CURSOR, cursor, 0o600, sync=True)

    def _quarantine(self, path: Path, offset: int, line: bytes, fault: Fault) -> None:
        """Keep a line that can never be shipped, with where it was and why; never its content in
        the log. The cursor moves past it only after this is on disk."""
        entry = {
            "time": datetime.now(UTC).isoformat(),
            "segment": path.name,
            "offset": offset,
            "fault": str(fault),
            "line": line.decode("utf-8", "backslashreplace"),
        }
        fd = os.open(self.directory / QUARANTINE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, json.dumps(entry).encode() + b"\n")  # ensure_ascii: always writable
            os.fsync(fd)
        finally:
            os.close(fd)
        self.quarantined += 1
        logger.warning(
            "quarantined an unshippable spool line (%s) at %s offset %d into %s",
            fault,
            path.name,
            offset,
            QUARANTINE,
        )

    def _next_batch(self) -> tuple[list[object], int, int]:
        segment, offset = self._cursor()
        for path in segments(self.directory):
            number = _segment_number(path)
            if number < segment:
                continue
            start = offset if number == segment else 0
            with path.open("rb") as handle:
                handle.seek(start)
                data = handle.read(4 << 20)
            records: list[object] = []
            consumed = 0
            for line in data.split(b"\n")[:-1]:  # only complete lines
                if line:
                    record, fault = _fault(line)
                    if fault is None:
                        records.append(record)
                    else:
                        self._quarantine(path, start + consumed, line, fault)
                consumed += len(line) + 1
                if len(records) >= self.batch_size:
                    break
            if records:
                return records, number, start + consumed
            if consumed:
                return [], number, start + consumed  # only quarantined lines: move past them
            newer = [p for p in segments(self.directory) if _segment_number(p) > number]
            if newer:
                # Nothing complete is left here and nothing more will be written to it: what
                # remains, if anything, is a line torn by a crash.
                path.unlink(missing_ok=True)  # fully shipped and no longer written
                segment, offset = _segment_number(newer[0]), 0
                continue
            return [], number, start + consumed
        return [], segment, offset

    async def ship_once(self) -> int:
        """Ship one batch; return how many records the Console accepted, -1 if it refused."""
        records, segment, offset = self._next_batch()
        if not records:
            if (segment, offset) != self._cursor():
                self._save_cursor(segment, offset)
            return 0
        try:
            # Spooled lines are contract records already; one an older spool wrote that no longer
            # fits is sent as it is, and the Console quarantines it rather than refusing the batch.
            body = TrafficBatch(records=records)
            response = await self._client.post(self.url, json=body.model_dump(mode="json"))
        except httpx.HTTPError as exc:
            logger.info(
                "console unreachable, keeping %d records: %s", len(records), type(exc).__name__
            )
            return -1
        if not 200 <= response.status_code < 300:
            logger.info("console answered %d, keeping records", response.status_code)
            return -1
        self._save_cursor(segment, offset)
        self.shipped += len(records)
        return len(records)

    async def run(self) -> None:
        backoff = self.interval
        while True:
            try:
                sent = await self.ship_once()
            except Exception:
                logger.exception("traffic shipper failed; retrying")
                sent = -1
            if sent > 0:
                backoff = self.interval
                continue
            if sent == 0:
                backoff = self.interval
                await asyncio.sleep(self.interval)
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
