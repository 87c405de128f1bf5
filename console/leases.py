"""Row leases on provisioning jobs (PostgreSQL): which Console replica runs a CVM's provider job.

A CVM in a transitional state (`launching`, `updating`, `destroying`) is a job. Its row carries
`lease_owner` (a replica id: host, pid and a random part, new at every start) and `lease_until`
(database time). The route that makes the row transitional leases it to its own replica in the
same transaction; the replica renews every lease it holds every TTL/3 from a thread of its own
(one UPDATE for all of them, no connection held in between); a row whose lease is missing or
expired is claimable by any replica with `SELECT … FOR UPDATE SKIP LOCKED` (provisioning's
takeover), so two replicas never claim the same job and a killed replica's job is taken over
once, after its lease expires. Times are the database's `now()`, so replicas' clocks never matter.

The outcome is recorded only by the lease's owner (provisioning.finish), so a replica that lost
its lease (the database unreachable for longer than the TTL, then taken over) never writes over
the run that took over. SQLite (embedded, one process) has no leases: everything is this process's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta

from sqlalchemy import ColumnElement, Engine, and_, func, or_, update
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.models import Cvm

log = logging.getLogger("umbra.console.leases")


def new_replica_id() -> str:
    """Unique per process start: a restarted replica never mistakes its predecessor's leases for
    its own (those expire and are taken over like any dead replica's)."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{os.urandom(4).hex()}"


class JobLeases:
    def __init__(self, engine: Engine, *, enabled: bool, ttl_seconds: float) -> None:
        self.engine = engine
        self.enabled = enabled  # PostgreSQL only
        self.replica_id = new_replica_id()
        self.ttl = timedelta(seconds=ttl_seconds)
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the jobs call -------------------------------------------------------------------

    def take(self, session: Session, cvm_id: str) -> None:
        """Lease the CVM's job to this replica inside the caller's transaction (the one that makes
        it transitional, or the takeover's claim): no other replica can claim it from the commit
        on. The ORM object's lease fields are left stale (nothing reads them)."""
        if not self.enabled:
            return
        session.flush()
        session.execute(
            update(Cvm)
            .where(col(Cvm.id) == cvm_id)
            .values(lease_owner=self.replica_id, lease_until=func.now() + self.ttl)
        )

    def hold(self, cvm_id: str) -> None:
        """The job is queued or running here: renewed from now on."""
        with self._lock:
            self._held.add(cvm_id)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def drop(self, cvm_id: str) -> None:
        with self._lock:
            self._held.discard(cvm_id)

    def owns(self, cvm: Cvm) -> bool:
        return not self.enabled or cvm.lease_owner == self.replica_id

    def release(self, cvm_id: str) -> None:
        """Give the job up now (shutdown): expired at once, so a live replica takes it over at its
        next check instead of after the TTL."""
        self.drop(cvm_id)
        if not self.enabled:
            return
        try:
            with self.engine.begin() as connection:
                connection.execute(
                    update(Cvm)
                    .where(col(Cvm.id) == cvm_id, col(Cvm.lease_owner) == self.replica_id)
                    .values(lease_until=func.now())
                )
        except Exception as exc:  # expires by itself after the TTL
            log.warning("could not release the lease on %s (%s)", cvm_id, type(exc).__name__)

    @staticmethod
    def claimable() -> ColumnElement[bool]:
        """A transitional row no live replica holds."""
        return or_(col(Cvm.lease_owner).is_(None), col(Cvm.lease_until) < func.now())

    @staticmethod
    def cleared() -> dict[str, None]:
        return {"lease_owner": None, "lease_until": None}

    # -- the heartbeat ------------------------------------------------------------------------

    def renew(self) -> set[str]:
        """Extend every lease this replica holds; returns those it no longer holds (taken over
        after this replica could not renew in time), which are forgotten."""
        with self._lock:
            held = set(self._held)
        if not held or not self.enabled:
            return set()
        with self.engine.begin() as connection:
            kept = set(
                connection.execute(
                    update(Cvm)
                    .where(
                        and_(
                            col(Cvm.id).in_(sorted(held)),
                            col(Cvm.lease_owner) == self.replica_id,
                        )
                    )
                    .values(lease_until=func.now() + self.ttl)
                    .returning(col(Cvm.id))
                ).scalars()
            )
        lost = held - kept
        if lost:
            with self._lock:
                self._held -= lost
        return lost

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="umbra-job-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        interval = self.ttl.total_seconds() / 3
        while not self._stop.wait(interval):
            try:
                lost = self.renew()
            except Exception as exc:  # a database outage: the next beat retries
                log.warning("could not renew job leases (%s); retrying", type(exc).__name__)
                continue
            for cvm_id in sorted(lost):
                # Finished jobs are dropped before their lease is cleared, so this is a job
                # another replica took over: its outcome is no longer ours to record.
                log.warning("lost the job lease on %s to another replica", cvm_id)
