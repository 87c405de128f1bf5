"""`umbra ssh-proxy CVM`: OpenSSH's ProxyCommand for a Dev CVM.

Asks the Console where the CVM is and what it must be, opens aTLS to its ingress, verifies the
quote (release, CVM id, launch-bound keys, host key), pins the attested host key for ssh, and only
then relays stdin/stdout. stdout carries nothing but the SSH stream; a refusal is one line on
stderr naming the failed check, exit 1, before any SSH byte. Imports only what it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import ssl
import sys
from urllib.parse import urlsplit

from pydantic import ValidationError

from umbra.attest.session_info import SessionInfo
from umbra.cli.credentials import LoginMissing, PinConflict, fresh_login, pin_host_key
from umbra.cli.ssh_attest import AttestedSession, Check, Refused, connect_attested, fingerprint
from umbra.contracts.console_url import ConsoleUrlError, check_console_url
from umbra.contracts.session import SESSION_API

EXIT_REFUSED = 1
CONSOLE_TIMEOUT = 10.0
MAX_BODY = 1 << 20


def _get(url: str, token: str, timeout: float) -> tuple[int, bytes]:
    """One GET with the stdlib: httpx costs ~0.1-0.2 s of imports, and this runs per connection."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        return response.status, response.read(MAX_BODY)
    finally:
        conn.close()


def fetch_session(cvm_id: str, timeout: float = CONSOLE_TIMEOUT) -> SessionInfo:
    try:
        login = fresh_login()
    except LoginMissing as exc:
        raise Refused(Check.console, str(exc)) from None
    try:
        url = check_console_url(login.url).rstrip("/") + SESSION_API.format(cvm_id=cvm_id)
    except ConsoleUrlError as exc:
        raise Refused(Check.console, str(exc)) from None
    try:
        status, body = _get(url, login.token, timeout)
    except (OSError, http.client.HTTPException) as exc:
        raise Refused(
            Check.console, f"cannot reach the Console at {login.url} ({type(exc).__name__})"
        ) from None
    if status == 401:
        raise Refused(Check.console, "the Console login has expired: run `umbra auth login`")
    if status == 404:
        raise Refused(Check.console, f"no CVM {cvm_id} visible to you")
    if status != 200:
        raise Refused(Check.console, f"the Console answered {status}")
    try:
        return SessionInfo.model_validate_json(body)
    except ValidationError as exc:
        raise Refused(Check.console, f"malformed session info: {exc.errors()[0]['msg']}") from None


async def _relay(conn: object) -> None:
    from umbra.attest.atls import ATLSConnection, relay

    assert isinstance(conn, ATLSConnection)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, sys.stdout.buffer
    )
    stdout = asyncio.StreamWriter(transport, protocol, None, loop)

    try:
        await relay(conn, stdin, stdout)
    finally:
        await conn.close()
        stdout.close()


async def attest(cvm_id: str) -> AttestedSession:
    """Every check, in order; the attested host key pinned for ssh. Raises Refused."""
    info = await asyncio.to_thread(fetch_session, cvm_id)
    if info.cvm_id != cvm_id:
        raise Refused(Check.console, f"the Console answered for {info.cvm_id}, not {cvm_id}")
    session = await connect_attested(info)
    try:
        changed = pin_host_key(cvm_id, session.host_key, session.boot_id)
    except PinConflict as exc:  # another connection pinned this boot meanwhile
        await session.conn.close()
        raise Refused(Check.host_key_pin, str(exc)) from None
    if changed:  # a legitimate relaunch: a new attested boot with its own key
        print(
            f"umbra ssh-proxy: {cvm_id} restarted (boot {session.boot_id[:8]}): pinned its "
            f"attested host key {fingerprint(session.host_key)}",
            file=sys.stderr,
        )
    return session


async def run(cvm_id: str) -> None:
    session = await attest(cvm_id)
    await _relay(session.conn)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="umbra ssh-proxy", description=__doc__.split("\n")[0])
    parser.add_argument("cvm", help="the Dev CVM's id")
    args = parser.parse_args(argv)
    try:
        asyncio.run(run(args.cvm))
    except Refused as exc:
        line = " ".join(f"{exc.check}: {exc.reason}".split())[:800]
        print(f"umbra ssh-proxy: refused {args.cvm}: {line}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # anything else is still one line, never a traceback
        line = " ".join(f"{type(exc).__name__}: {exc}".split())[:800]
        print(f"umbra ssh-proxy: failed {args.cvm}: internal: {line}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
