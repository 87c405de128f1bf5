"""Dial guard: resolve, check every address, and dial exactly the checked one (502)."""

from __future__ import annotations

import ipaddress

from mitmproxy.proxy import server_hooks

from umbra.policy import normalize_host
from umbra.proxy.addons.base import UmbraAddon, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.mitm_compat import DIALLED_FOR
from umbra.proxy.netcheck import AddressVerdict, IPAddress, parse_ip
from umbra.proxy.resolver import ResolutionError


class DialGuard(UmbraAddon):
    @guard
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        shared = self.shared
        state = shared.conns.get(data.client)
        if data.server.address is None:
            raise ValueError("no server address")
        raw_host, port = str(data.server.address[0]), int(data.server.address[1])
        if state.poisoned:
            data.server.error = f"connection is poisoned: {state.poisoned}"
            return
        host = normalize_host(raw_host)
        log = shared.traffic.connection_record
        pinned_name = state.pinned_names.get((host, port))
        if pinned_name is not None:
            # mitmproxy asks for a further connection by the address it dialled before: that
            # address was checked for `pinned_name`; check it again and dial it.
            verdict = shared.addresses.check(ipaddress.ip_address(host), port)
            if verdict is not AddressVerdict.OK:
                data.server.error = f"refused address ({verdict})"
                log(data.client, host, port, f"address_{verdict}", host)
                return
            data.server.sni = pinned_name
            return
        if (host, port) not in state.authorized:
            data.server.error = "no allowed decision for this destination"
            log(data.client, host, port, Reason.UNAUTHORIZED_DIAL, data.server.error)
            return
        addresses: list[IPAddress]
        literal = parse_ip(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = await shared.resolver.resolve(host)
            except ResolutionError as exc:
                data.server.error = str(exc)
                log(data.client, host, port, Reason.DNS_FAILURE, str(exc))
                return
        for address in addresses:
            verdict = shared.addresses.check(address, port)
            if verdict is not AddressVerdict.OK:
                data.server.error = f"{host} resolves to a refused address ({verdict})"
                log(data.client, host, port, f"address_{verdict}", str(address), str(address))
                return
        pinned = addresses[0]
        state.pinned[(host, port)] = str(pinned)
        if literal is None:
            state.pinned_names[(str(pinned), port)] = host
            data.server.sni = host
        # Dial exactly the address that was checked (mitmproxy would otherwise resolve again), and
        # let later requests for the same name on this client connection reuse it (mitm_compat).
        setattr(data.server, DIALLED_FOR, (raw_host, port))
        data.server.address = (str(pinned), port)
