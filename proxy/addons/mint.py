"""Minting: before injection, the access tokens the flow's injections need (OAuth kinds), from
the Security CVM's cache or its token endpoint (`proxy/minting.py`), bounded; a refusal answers
403 `credential_refresh_failed`, a slow or down endpoint 503 `credential_unavailable`."""

from __future__ import annotations

from mitmproxy import http

from umbra.contracts.secret_kinds import MINTED_KINDS
from umbra.policy import normalize_host
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import Stage, flow_state
from umbra.proxy.mint_errors import CredentialRefused, MintError

# flow.metadata key: {secret ref: minted access token} for the injection addon (never logged).
MINTED = "umbra.minted"


class Mint(UmbraAddon):
    @guard
    async def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        request = flow.request
        if request.method == "CONNECT" or fstate.denied or fstate.stage is not Stage.GATED:
            return
        if fstate.effective is None or fstate.decision is None or request.scheme != "https":
            return  # the injection addon refuses these
        state = self.shared.conns.get(flow.client_conn)
        identity = state.identity
        if identity is None:
            return
        host = state.connect_host or normalize_host(request.host)
        port = request.port if state.connect_port is None else state.connect_port
        injections = fstate.effective.policy.applicable_injections(host, port, fstate.decision)
        secrets = self.shared.state.secrets
        minted: dict[str, str] = {}
        for rule in injections:
            for ref in rule.refs:
                material = secrets.material(ref, identity.owner, host)
                if material is None or material.document.kind not in MINTED_KINDS:
                    continue
                minter = self.shared.minter
                if minter is None:
                    deny(self.shared, flow, Denied(
                        Reason.CREDENTIAL_UNAVAILABLE, "this proxy mints no tokens", rule.id
                    ))  # fmt: skip
                    return
                try:
                    minted[ref] = await minter.token(secrets.key(ref, identity.owner), material)
                except CredentialRefused as exc:
                    deny(self.shared, flow, Denied(
                        Reason.CREDENTIAL_REFRESH_FAILED, f"{ref}: {exc}", rule.id
                    ))  # fmt: skip
                    return
                except MintError as exc:
                    deny(self.shared, flow, Denied(
                        Reason.CREDENTIAL_UNAVAILABLE, f"{ref}: {exc}", rule.id
                    ))  # fmt: skip
                    return
        if minted:
            flow.metadata[MINTED] = minted
