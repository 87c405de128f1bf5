"""`python -m umbra.cli.tls_front`: TLS in front of the embedded Console, for `umbra up --runtime
qemu` only. The Console serves plain HTTP on loopback (the developer's CLI and the host's
components reach it there); a Dev CVM in a VM enrolls over TLS for the name its release measures
(`https://console.umbra.internal`, the launch data carrying the CA), reaching this listener by a
QEMU forward. Each connection: the TLS handshake with the given certificate, then bytes relayed
both ways to the Console's port, unchanged. Never used outside the embedded stack."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.close()


def handler(host: str, port: int) -> object:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, upstream_w), _pipe(upstream_r, client_w))

    return relay


async def serve(cert: str, key: str, listen: tuple[str, int], to: tuple[str, int]) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    server = await asyncio.start_server(
        handler(*to),  # type: ignore[arg-type]
        listen[0],
        listen[1],
        ssl=context,
    )
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="umbra.cli.tls_front")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--listen", required=True, type=_address)
    parser.add_argument("--to", required=True, type=_address)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.cert, args.key, args.listen, args.to))


if __name__ == "__main__":
    main()
