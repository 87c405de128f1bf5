"""A real MCP server (the `mcp` package's MCPServer, streamable HTTP, under uvicorn with TLS) on
loopback, and a real MCP client session through the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import uvicorn
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

from tests.proxy.harness import ALICE_TOKEN, ProxyProcess


def build_server() -> MCPServer:
    server = MCPServer("umbra-test")

    @server.tool()
    def echo(text: str) -> str:
        """Say the text back."""
        return f"echo: {text}"

    @server.tool()
    def create_issue(repo: str, title: str) -> str:
        """Open an issue."""
        return f"opened {repo}: {title}"

    @server.tool()
    def delete_repo(repo: str) -> str:
        """Delete a repository."""
        return f"deleted {repo}"

    return server


class McpOrigin:
    """Serves `server` over HTTPS on a free loopback port until `stop`."""

    def __init__(
        self, server: MCPServer, cert: Path, key: Path, app: Callable[..., Any] | None = None
    ) -> None:
        self.server = server
        app = app or server.streamable_http_app(
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            ssl_certfile=str(cert),
            ssl_keyfile=str(key),
            log_level="warning",
            lifespan="on",
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def start(self) -> McpOrigin:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uvicorn.started:
            if time.monotonic() > deadline:
                raise RuntimeError("MCP origin did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)


def proxied_client(proxy: ProxyProcess, cvm: str = "cvm-alice") -> httpx2.AsyncClient:
    context = ssl.create_default_context(cafile=str(proxy.ca))
    return httpx2.AsyncClient(
        proxy=f"http://{cvm}:{ALICE_TOKEN}@127.0.0.1:{proxy.port}",
        verify=context,
        timeout=httpx2.Timeout(20),
    )


@contextlib.asynccontextmanager
async def session(proxy: ProxyProcess, url: str) -> AsyncIterator[ClientSession]:
    async with (
        proxied_client(proxy) as client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write) as mcp_session,
    ):
        await asyncio.wait_for(mcp_session.initialize(), 20)
        yield mcp_session
