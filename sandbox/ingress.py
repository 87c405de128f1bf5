"""The Dev CVM's attested SSH ingress: one port, aTLS, then a gateway `sshd -i` per connection.

The client (`umbra ssh-proxy`) verifies a fresh quote bound to the TLS session before it sends a
single SSH byte; the quote's RTMR3 carries the CVM id, the launch-bound authorized-keys digest,
this boot's id and this CVM's SSH host key (`umbra.ssh-host-key`), so the client learns the host
key from the quote. Each connection's report_data also binds the host key this ingress is about
to hand that connection's sshd (aTLS `bind`): a key file swapped after boot is refused by the
client before sshd even starts. See docs/specs/session.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from umbra.attest.atls import ATLSConnection, relay, serve_atls
from umbra.attest.errors import ATLSError, AttestError
from umbra.attest.eventlog import RUNTIME_EVENT_TYPE, Event, load_event_log
from umbra.attest.measurement import SSH_KEYS_EVENT, ssh_keys_digest
from umbra.attest.quote_source import (
    ConfigfsTsmSource,
    QuoteSource,
    QuoteSourceKind,
    SimulatedSource,
)
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tdx_port import TdxModuleSource
from umbra.contracts.session import BOOT_ID_EVENT, CVM_ID_EVENT, SSH_HOST_KEY_EVENT
from umbra.sandbox import gateway_sshd
from umbra.sandbox.ingress_config import IngressConfig, IngressConfigError

log = logging.getLogger("umbra.sandbox.ingress")
SSHD_EXIT_GRACE = 5.0


@dataclass(frozen=True)
class Evidence:
    source: QuoteSource
    event_log: Callable[[], Sequence[Event]] | None


def _load_events(config: IngressConfig) -> list[Event] | None:
    path = config.quote_source.event_log
    if path is None:
        return None
    try:
        return load_event_log(path.read_bytes())
    except OSError as exc:
        raise IngressConfigError(f"{path}: {exc.strerror}") from None
    except AttestError as exc:
        raise IngressConfigError(f"{path}: not a valid event log: {exc}") from None


def build_evidence(
    config: IngressConfig, launch: gateway_sshd.LaunchData, host_key: str
) -> Evidence:
    """Quotes whose RTMR3 binds the CVM id, the login keys, this boot and this host key."""
    qs = config.quote_source
    events = _load_events(config)
    payload = host_key.encode()

    def named(name: str) -> list[Event]:
        return [e for e in events or () if e.event_type == RUNTIME_EVENT_TYPE and e.name == name]

    def check_agent_bound() -> None:
        hits = named(SSH_HOST_KEY_EVENT)
        if len(hits) != 1 or hits[0].payload != payload:
            raise IngressConfigError(
                f"{qs.event_log}: the launch agent has not bound this host key "
                f"({SSH_HOST_KEY_EVENT} must appear once with {host_key[:40]}…)"
            )
        if len(named(BOOT_ID_EVENT)) != 1:
            raise IngressConfigError(
                f"{qs.event_log}: the launch agent has not bound a boot id "
                f"({BOOT_ID_EVENT} must appear once)"
            )

    if qs.kind in (QuoteSourceKind.configfs, QuoteSourceKind.emulated):
        # The launch agent generated the key, extended the events and wrote the log before us.
        if events is None:
            raise IngressConfigError(f"quote_source.event_log is required with kind {qs.kind}")
        check_agent_bound()
        fixed = list(events)
        configfs = qs.kind is QuoteSourceKind.configfs
        td: QuoteSource = ConfigfsTsmSource() if configfs else TdxModuleSource()
        return Evidence(td, lambda: fixed)
    assert qs.simulated_pki is not None  # the model requires it
    try:
        tdx = SimulatedTdx(SimulatedPki.load(qs.simulated_pki), image=qs.simulated_image)
    except (OSError, AttestError, ValueError) as exc:
        raise IngressConfigError(
            f"{qs.simulated_pki}: cannot load the simulated PKI: {exc}"
        ) from None
    if events is not None:
        for event in events:
            if event.name:  # runtime events only; the simulator has its own boot events
                tdx.extend_runtime_event(event.name, event.payload, event.imr)
    else:  # the embedded default: the ingress is the launch agent of its simulated TD
        tdx.extend_runtime_event(CVM_ID_EVENT, launch.cvm_id.encode())
        tdx.extend_runtime_event(SSH_KEYS_EVENT, ssh_keys_digest(list(launch.authorized_keys)))
    if named(SSH_HOST_KEY_EVENT):  # a launch agent's log (simulated TEE): it bound them
        check_agent_bound()
        return Evidence(SimulatedSource(tdx), tdx.event_log)
    if not named(BOOT_ID_EVENT):  # this start of the ingress is this simulated TD's boot
        tdx.extend_runtime_event(BOOT_ID_EVENT, os.urandom(16).hex().encode())
    tdx.extend_runtime_event(SSH_HOST_KEY_EVENT, payload)
    return Evidence(SimulatedSource(tdx), tdx.event_log)


@dataclass
class IngressStats:
    sessions: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


class Ingress:
    def __init__(self, config: IngressConfig) -> None:
        self.config = config
        self.launch = gateway_sshd.read_launch(config.launch_dir)
        self.host_key = gateway_sshd.prepare(config, self.launch)
        self.evidence = build_evidence(config, self.launch, self.host_key)
        self.stats = IngressStats()
        self._slots = asyncio.Semaphore(config.max_connections)
        self.server: asyncio.Server | None = None

    async def start(self) -> asyncio.Server:
        self.server = await serve_atls(
            self.config.listen.host,
            self.config.listen.port,
            self._handle,
            self.evidence.source,
            event_log=self.evidence.event_log,
            handshake_timeout=self.config.handshake_timeout,
            on_error=self._on_error,
            bind=self._bind,
        )
        return self.server

    async def serve_forever(self) -> None:
        server = await self.start()
        async with server:
            await server.serve_forever()

    def _bind(self) -> bytes:
        """Per connection: the host key its sshd will get, read now (a swap shows here)."""
        line = gateway_sshd.snapshot_host_key(self.config.state_dir)
        if line != self.host_key:
            log.warning("the host key file changed since boot: binding %s…", line[:40])
        return line.encode()

    def _on_error(self, exc: ATLSError) -> None:
        self.stats.refuse("atls")
        log.info("aTLS handshake failed: %s", exc)

    async def _handle(self, conn: ATLSConnection) -> None:
        if self._slots.locked():
            self.stats.refuse("too_many_connections")
            return
        async with self._slots:
            self.stats.sessions += 1
            await self._run_sshd(conn)

    async def _run_sshd(self, conn: ATLSConnection) -> None:
        if conn.binding is None:  # serve_atls always binds here; never start sshd unbound
            return
        key_file = gateway_sshd.bound_key_path(self.config.state_dir, conn.binding.decode())
        ours, theirs = socket.socketpair()
        try:
            # In a thread: finding the sandbox may ask the Docker engine (sandbox_locator.py).
            argv = await asyncio.to_thread(gateway_sshd.sshd_argv, self.config, key_file)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=theirs.fileno(), stdout=theirs.fileno(), close_fds=True
            )
        except (OSError, IngressConfigError) as exc:
            log.error("cannot start sshd: %s", exc)
            ours.close()
            theirs.close()
            return
        theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            # sshd ending the session ends the relay; the client's EOF only half-closes toward sshd.
            await relay(conn, reader, writer, peer_eof_grace=None)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
            try:
                await asyncio.wait_for(proc.wait(), SSHD_EXIT_GRACE)
            except TimeoutError:
                proc.kill()
                await proc.wait()
