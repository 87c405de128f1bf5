"""Secret kinds: what a stored secret holds beside a plain value, defined once for the CLI (which
validates a file before sending it), the Console (which validates again before sealing) and the
Security CVM (which parses what a release carries).

`static` is a value injected as is. The others are documents (JSON objects with these fields) the
Security CVM turns into what a request needs: an OAuth access token minted from a refresh token,
client credentials or a Google service-account key (JWT bearer grant), a GitHub App installation
token (a JWT signed as the app), or an AWS SigV4 signature
made with the real key in place of the sandbox's placeholder one. No document ever prints a value
(its repr is its kind), and a validation error never quotes its input
(`contracts.validation`).
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, TypeAdapter

from umbra.contracts.model import Strict

MAX_MATERIAL_BYTES = 64 << 10


class SecretKind(StrEnum):
    static = "static"
    oauth2_refresh = "oauth2-refresh"
    oauth2_client_credentials = "oauth2-client-credentials"
    google_service_account = "google-service-account"
    aws_sigv4 = "aws-sigv4"
    github_app = "github-app"


MINTED_KINDS = frozenset(
    {
        SecretKind.oauth2_refresh,
        SecretKind.oauth2_client_credentials,
        SecretKind.google_service_account,
        SecretKind.github_app,
    }
)


def _https_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme != "https" or not parts.hostname or parts.username or parts.password:
        raise ValueError("must be an https:// URL with a host and no user info")
    if parts.fragment:
        raise ValueError("must not carry a fragment")
    return value


TokenUrl = Annotated[str, Field(max_length=2048), AfterValidator(_https_url)]
Text = Annotated[str, Field(min_length=1, max_length=8192)]
SecretText = Annotated[str, Field(min_length=1, max_length=16384)]
Scopes = Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]], Field(max_length=64)]


class _Document(Strict):
    """A secret's document: printed, it shows its kind only."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<redacted>)"

    __str__ = __repr__


class StaticSecret(_Document):
    kind: Literal[SecretKind.static] = SecretKind.static
    value: SecretText

    def sensitive(self) -> list[str]:
        return [self.value]


class OAuth2Refresh(_Document):
    """A refresh token (e.g. a ChatGPT login's); the Security CVM mints access tokens from it and
    persists a rotated refresh token back to the Console. `access_token`/`expires_at` are the last
    minted token, written back with a rotation so another replica need not refresh again."""

    kind: Literal[SecretKind.oauth2_refresh]
    token_url: TokenUrl
    client_id: Text
    client_secret: SecretText | None = None
    refresh_token: SecretText
    scope: Text | None = None
    access_token: SecretText | None = None
    expires_at: float | None = Field(default=None, ge=0, description="Unix time.")

    def sensitive(self) -> list[str]:
        return [v for v in (self.client_secret, self.refresh_token, self.access_token) if v]


class OAuth2ClientCredentials(_Document):
    kind: Literal[SecretKind.oauth2_client_credentials]
    token_url: TokenUrl
    client_id: Text
    client_secret: SecretText
    scope: Text | None = None
    audience: Text | None = None
    # RFC 6749 §2.3.1: HTTP Basic is what servers must accept; `body` for those that want the
    # credentials as form fields.
    client_auth: Literal["basic", "body"] = "basic"

    def sensitive(self) -> list[str]:
        return [self.client_secret]


class GoogleServiceAccount(_Document):
    """The fields of a Google service-account key file that minting needs (JWT bearer grant,
    RFC 7523, signed RS256); `from_key_file` keeps only these."""

    kind: Literal[SecretKind.google_service_account]
    client_email: Text
    private_key: SecretText
    private_key_id: Text | None = None
    token_uri: TokenUrl = "https://oauth2.googleapis.com/token"  # noqa: S105 (a URL)
    scopes: Scopes = Field(min_length=1)

    def sensitive(self) -> list[str]:
        return [self.private_key]


def _rsa_pem(value: str) -> str:
    # An RSA key as GitHub issues it (PKCS#1) or converted to PKCS#8; the Security CVM loads it.
    # Anything else (EC, encrypted, a public key, a certificate) is refused here, unquoted.
    text = value.strip()
    if not _RSA_PEM.fullmatch(text):
        raise ValueError(
            "must be an unencrypted RSA private key in PEM "
            "(-----BEGIN RSA PRIVATE KEY----- or -----BEGIN PRIVATE KEY-----)"
        )
    return value


_RSA_PEM = re.compile(
    r"-----BEGIN ((?:RSA )?)PRIVATE KEY-----\r?\n[A-Za-z0-9+/=\r\n]+-----END \1PRIVATE KEY-----"
)


class GitHubApp(_Document):
    """A GitHub App's installation: the Security CVM signs an RS256 JWT as the app (`app_id`) and
    exchanges it for an installation access token (`POST /app/installations/{id}/access_tokens`
    on `api_url`)."""

    kind: Literal[SecretKind.github_app]
    app_id: Annotated[int, Field(ge=1, le=2**53)]
    installation_id: Annotated[int, Field(ge=1, le=2**53)]
    private_key: Annotated[SecretText, AfterValidator(_rsa_pem)]
    api_url: TokenUrl = "https://api.github.com"

    def sensitive(self) -> list[str]:
        return [self.private_key]


class AwsSigv4(_Document):
    kind: Literal[SecretKind.aws_sigv4]
    access_key_id: Annotated[str, Field(pattern=r"^[A-Z0-9]{16,128}$")]
    secret_access_key: SecretText
    session_token: SecretText | None = None

    def sensitive(self) -> list[str]:
        return [v for v in (self.secret_access_key, self.session_token) if v]


SecretMaterial = Annotated[
    StaticSecret
    | OAuth2Refresh
    | OAuth2ClientCredentials
    | GoogleServiceAccount
    | GitHubApp
    | AwsSigv4,
    Field(discriminator="kind"),
]
MintedMaterial = OAuth2Refresh | OAuth2ClientCredentials | GoogleServiceAccount | GitHubApp
_ADAPTER: TypeAdapter[SecretMaterial] = TypeAdapter(SecretMaterial)

# Informational fields of a Google key file that minting does not need.
_GOOGLE_FILE_EXTRAS = frozenset(
    {
        "type",
        "project_id",
        "client_id",
        "auth_uri",
        "auth_provider_x509_cert_url",
        "client_x509_cert_url",
        "universe_domain",
    }
)


def parse_material(kind: SecretKind, text: str) -> SecretMaterial:
    """The secret's document for `kind` (a static secret's text is its value). Raises
    ValidationError (never quoting the input) or ValueError for a document that is not JSON."""
    if kind == SecretKind.static:
        return StaticSecret(value=text)
    if len(text.encode()) > MAX_MATERIAL_BYTES:
        raise ValueError(f"the {kind} document is larger than {MAX_MATERIAL_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"the {kind} document is not JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"the {kind} document must be a JSON object")
    if kind == SecretKind.google_service_account and data.get("type") == "service_account":
        data = {key: value for key, value in data.items() if key not in _GOOGLE_FILE_EXTRAS}
    given = data.setdefault("kind", str(kind))
    if given != kind:
        raise ValueError(f"the document says kind {str(given)[:40]!r}, not {kind}")
    return _ADAPTER.validate_python(data)


def material_text(material: SecretMaterial) -> str:
    """What is sealed: a static value as is, any other kind as its JSON document."""
    if isinstance(material, StaticSecret):
        return material.value
    return material.model_dump_json(exclude_none=True)


__all__ = [
    "MAX_MATERIAL_BYTES",
    "MINTED_KINDS",
    "AwsSigv4",
    "GitHubApp",
    "GoogleServiceAccount",
    "MintedMaterial",
    "OAuth2ClientCredentials",
    "OAuth2Refresh",
    "SecretKind",
    "SecretMaterial",
    "StaticSecret",
    "material_text",
    "parse_material",
]
