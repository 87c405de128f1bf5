"""Real Linux network namespaces for topology tests: created, used and always deleted here.

Only addresses inside namespaces we create (10.200.0.0/16, fd00:200::/32) are ever used.
Code runs "inside" a namespace on a dedicated thread that setns()'d into it: a network
namespace is per thread, and sockets keep the namespace they were created in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def require_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` (scripts/system-deps installs it)")


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def ip_may_fail(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@contextmanager
def namespaces(*roles: str) -> Iterator[dict[str, str]]:
    """Create one namespace per role (named umbra-t-<pid>-<n>-<role>); delete them on exit."""
    prefix = f"umbra-t-{os.getpid()}-{next(_counter)}-"
    names = {r: prefix + r for r in roles}
    created: list[str] = []
    try:
        for name in names.values():
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
            set_sysctls(name, BASE_SYSCTLS)
        yield names
    finally:
        for name in created:
            ip_may_fail("netns", "del", name)


# Every namespace gets these explicitly: a new namespace may inherit the host's values (Docker
# sets the host's ip_forward to 1), and the topology must never depend on host defaults.
BASE_SYSCTLS: dict[str, str] = {
    "net.ipv4.ip_forward": "0",
    "net.ipv4.conf.all.forwarding": "0",
    "net.ipv4.conf.default.forwarding": "0",
    "net.ipv6.conf.all.forwarding": "0",
    "net.ipv6.conf.default.forwarding": "0",
    "net.ipv4.conf.all.accept_redirects": "0",
    "net.ipv4.conf.default.accept_redirects": "0",
    "net.ipv4.conf.all.send_redirects": "0",
    "net.ipv4.conf.default.send_redirects": "0",
    "net.ipv4.conf.all.accept_source_route": "0",
    "net.ipv4.conf.default.accept_source_route": "0",
    "net.ipv4.conf.all.proxy_arp": "0",
    "net.ipv4.conf.default.proxy_arp": "0",
    "net.ipv6.conf.all.accept_redirects": "0",
    "net.ipv6.conf.default.accept_redirects": "0",
    "net.ipv6.conf.all.accept_ra": "0",
    "net.ipv6.conf.default.accept_ra": "0",
}


def set_sysctls(ns: str, values: dict[str, str]) -> None:
    """Write each sysctl inside `ns` and read it back: a value that did not stick is an error."""
    for key, value in values.items():
        path = "/proc/sys/" + key.replace(".", "/")
        script = f"echo {value} > {path} && cat {path}"
        got = ip("netns", "exec", ns, "sh", "-c", script).strip()
        if got != value:
            raise RuntimeError(f"{ns}: {key} is {got!r} after writing {value!r}")


def _count() -> Iterator[int]:
    n = 0
    while True:
        n += 1
        yield n


_counter = _count()


def veth(ns_a: str, if_a: str, addr_a: str, ns_b: str, if_b: str, addr_b: str) -> None:
    ip("link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
    for ns, ifname, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
        for a in addr.split(","):
            ip("-n", ns, "addr", "add", a, "dev", ifname, *(["nodad"] if ":" in a else []))
        ip("-n", ns, "link", "set", ifname, "up")


def _enter(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        os.setns(fd, os.CLONE_NEWNET)
    finally:
        os.close(fd)


def run_in[R](ns: str, fn: Callable[[], R], timeout: float = 60) -> R:
    """Run `fn` on a fresh thread inside `ns`; return its result or raise its exception."""
    out: concurrent.futures.Future[R] = concurrent.futures.Future()

    def body() -> None:
        try:
            _enter(ns)
            out.set_result(fn())
        except BaseException as exc:  # handed to the caller
            out.set_exception(exc)

    threading.Thread(target=body, daemon=True).start()
    return out.result(timeout)


class LoopIn:
    """An asyncio loop on its own thread inside `ns`: servers started on it listen there."""

    def __init__(self, ns: str) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def body() -> None:
            _enter(ns)
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"event loop in {ns} did not start")

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            self.run(cancel_all(), timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.loop.close()
