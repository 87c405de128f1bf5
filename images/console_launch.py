"""The Console VM's part of the launch (the launch agent calls these; docs/specs/infra.md "The
Console VM's launch"): its launch data checked for consistency, its secrets read with the VM's
identity and checked against what is measured, and the files the Console's compose mounts.

Everything here runs before anything is measured or started: a Console whose TLS key does not
match its measured certificate, whose database URL names a CA it was not given, or whose secrets
cannot be read starts nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from umbra.components.launch_data import (
    DATABASE_CA_PATH,
    META_CONSOLE_TLS_CERT,
    META_CONSOLE_TLS_KEY_REF,
    META_DATABASE_CA,
    META_DATABASE_PASSWORD_REF,
    META_DATABASE_URL,
    META_WEB_SESSION_KEY_REF,
    LaunchData,
)
from umbra.components.secret_refs import CLOUD_STORE, secret_store
from umbra.contracts.files import write_atomic
from umbra.contracts.web_session_key import decode_web_session_key
from umbra.images.launch_secrets import SecretReader, SecretReadError
from umbra.sandbox.models import check_image_ref
from umbra.sandbox.render import SERVICE_UID
from umbra.sandbox.validate import FORBIDDEN_SERVICE_KEYS, ComposeError, load_compose

CONSOLE_KEYS = (
    META_DATABASE_URL,
    META_DATABASE_PASSWORD_REF,
    META_CONSOLE_TLS_CERT,
    META_CONSOLE_TLS_KEY_REF,
)
# Under the launch directory; the Console's compose mounts `console/` read-only.
CONSOLE_DIR = "console"
DATABASE_URL_FILE = "database-url"  # the full URL, password included (0400, the service uid)
TLS_KEY_FILE = "tls.key"
TLS_CERT_FILE = "tls.crt"
# The Console's UMBRA_CONSOLE_WEB_SESSION_KEY_FILE (0400, the service uid), when the launch has one.
WEB_SESSION_KEY_FILE = "web-session-key"


class ConsoleProblem(StrEnum):
    MISSING = "missing"
    INVALID = "invalid"
    MISMATCH = "mismatch"
    SECRET_UNREADABLE = "secret_unreadable"  # noqa: S105 (a reason)


class ConsoleLaunchError(Exception):
    def __init__(self, problem: ConsoleProblem, detail: str) -> None:
        super().__init__(detail)
        self.problem = problem


@dataclass(frozen=True)
class ConsoleSecrets:
    """Read at boot, written only to the Console's 0400 files: never logged or measured."""

    database_password: str = field(repr=False)
    tls_key: str = field(repr=False)
    web_session_key: str | None = field(default=None, repr=False)


def check_console_meta(meta: dict[str, str], role: str, cloud: str | None) -> None:
    """The Console's keys come together, only on a Console, with references for this cloud."""
    present = [k for k in (*CONSOLE_KEYS, META_WEB_SESSION_KEY_REF) if k in meta]
    if role != "console":
        if present:
            raise ConsoleLaunchError(
                ConsoleProblem.INVALID, f"{present}: only a Console takes these"
            )
        return
    missing = [k for k in CONSOLE_KEYS if k not in meta]
    if missing:
        raise ConsoleLaunchError(ConsoleProblem.MISSING, f"a Console launch needs {missing}")
    for key in (META_DATABASE_PASSWORD_REF, META_CONSOLE_TLS_KEY_REF, META_WEB_SESSION_KEY_REF):
        if key not in meta:  # the web session key's is optional
            continue
        try:
            store = secret_store(meta[key])
        except ValueError as exc:
            raise ConsoleLaunchError(ConsoleProblem.INVALID, f"{key}: {exc}") from None
        if cloud in CLOUD_STORE and store != CLOUD_STORE[cloud]:
            raise ConsoleLaunchError(
                ConsoleProblem.MISMATCH, f"{key}: a {store} reference on {cloud}"
            )
    _check_database(meta[META_DATABASE_URL], meta.get(META_DATABASE_CA))
    _certificates(META_CONSOLE_TLS_CERT, meta[META_CONSOLE_TLS_CERT])


def _check_database(url: str, ca: str | None) -> None:
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = -1
    if u.scheme != "postgresql" or not u.username or not u.hostname or not u.path[1:] or port == -1:
        raise ConsoleLaunchError(
            ConsoleProblem.INVALID, f"{META_DATABASE_URL}: want postgresql://user@host[:port]/db"
        )
    if u.password is not None:
        # The password is a secret: it is read by reference, never carried in launch data.
        raise ConsoleLaunchError(ConsoleProblem.INVALID, f"{META_DATABASE_URL} carries a password")
    query = parse_qs(u.query, strict_parsing=bool(u.query))
    if query.get("sslmode") != ["verify-full"]:
        raise ConsoleLaunchError(ConsoleProblem.INVALID, f"{META_DATABASE_URL}: want verify-full")
    root = query.get("sslrootcert")
    if root is not None and root != [DATABASE_CA_PATH]:
        raise ConsoleLaunchError(
            ConsoleProblem.INVALID, f"{META_DATABASE_URL}: sslrootcert must be {DATABASE_CA_PATH}"
        )
    if root is not None and ca is None:
        raise ConsoleLaunchError(
            ConsoleProblem.MISSING, f"{META_DATABASE_URL} verifies against {META_DATABASE_CA}"
        )
    if root is None and ca is not None:
        # A CA the URL does not use would be measured but not enforced: refused.
        raise ConsoleLaunchError(
            ConsoleProblem.MISMATCH, f"{META_DATABASE_CA} given but the URL does not use it"
        )
    if ca is not None:
        _certificates(META_DATABASE_CA, ca)


def _certificates(key: str, pem: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        raise ConsoleLaunchError(ConsoleProblem.INVALID, f"{key}: not PEM certificates") from None
    return certs


def check_console_compose(compose: str) -> None:
    """The Console's compose: parsed back, no forbidden service key, every image by digest."""
    problems: list[str] = []
    try:
        doc = load_compose(compose)
    except ComposeError as exc:
        problems = exc.problems
        doc = {}
    services = doc.get("services")
    if not problems and (not isinstance(services, dict) or not services):
        problems.append("services: want at least one")
    for name, svc in (services or {}).items() if isinstance(services, dict) else ():
        if not isinstance(svc, dict):
            problems.append(f"services.{name}: not a mapping")
            continue
        problems += [f"services.{name}.{k}: {FORBIDDEN_SERVICE_KEYS[k]}" for k in svc
                     if k in FORBIDDEN_SERVICE_KEYS]  # fmt: skip
        try:
            check_image_ref(str(svc.get("image", "")))
        except ValueError as exc:
            problems.append(f"services.{name}.image: {exc}")
    if problems:
        raise ComposeError(problems)


def _read(reader: SecretReader, key: str, ref: str) -> str:
    try:
        value = reader.read(ref)
    except (SecretReadError, ValueError) as exc:
        raise ConsoleLaunchError(ConsoleProblem.SECRET_UNREADABLE, f"{key}: {exc}") from None
    if not value:
        raise ConsoleLaunchError(ConsoleProblem.SECRET_UNREADABLE, f"{key}: empty secret")
    return value


def read_console_secrets(data: LaunchData, reader: SecretReader) -> ConsoleSecrets:
    """Its secrets, the TLS key checked against the measured certificate's public key and the web
    session key (if referenced) against the Console's WEB_SESSION_KEY shape."""
    assert data.database_password_ref and data.console_tls_key_ref and data.console_tls_cert
    password = _read(reader, META_DATABASE_PASSWORD_REF, data.database_password_ref)
    tls_key = _read(reader, META_CONSOLE_TLS_KEY_REF, data.console_tls_key_ref)
    web_key = None
    if data.web_session_key_ref:
        web_key = _read(reader, META_WEB_SESSION_KEY_REF, data.web_session_key_ref).strip()
        try:
            decode_web_session_key(web_key)
        except ValueError as exc:
            # Refused here, not by a Console that would fail to start after the launch is measured.
            raise ConsoleLaunchError(
                ConsoleProblem.INVALID,
                f"{META_WEB_SESSION_KEY_REF}: {exc} (want base64 of 32 bytes)",
            ) from None
    leaf = _certificates(META_CONSOLE_TLS_CERT, data.console_tls_cert)[0]
    try:
        private = serialization.load_pem_private_key(tls_key.encode(), password=None)
    except (ValueError, TypeError):
        raise ConsoleLaunchError(
            ConsoleProblem.INVALID, f"{META_CONSOLE_TLS_KEY_REF}: not an unencrypted PEM key"
        ) from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if private.public_key().public_bytes(der, spki) != leaf.public_key().public_bytes(der, spki):
        raise ConsoleLaunchError(
            ConsoleProblem.MISMATCH,
            f"{META_CONSOLE_TLS_KEY_REF}: the key is not {META_CONSOLE_TLS_CERT}'s",
        )
    return ConsoleSecrets(password, tls_key, web_key)


def database_url_with_password(url: str, password: str) -> str:
    u = urlsplit(url)
    user, host = u.netloc.rsplit("@", 1)
    return urlunsplit(u._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def _write(path: Path, data: str, mode: int, owner: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    write_atomic(path, data, mode, owner=None if owner is None else (owner, owner))


def write_console_files(
    root: Path, data: LaunchData, secrets: ConsoleSecrets, owner: int | None = SERVICE_UID
) -> None:
    """The Console's files: its database URL (with the password), TLS key and web session key
    (if any) readable by its uid alone, its certificate chain, the database CA where the URL's sslrootcert names it.
    `owner`: None in tests that do not run as root."""
    assert data.database_url and data.console_tls_cert
    console = root / CONSOLE_DIR
    url = database_url_with_password(data.database_url, secrets.database_password)
    _write(console / DATABASE_URL_FILE, url + "\n", 0o400, owner)
    _write(console / TLS_KEY_FILE, secrets.tls_key, 0o400, owner)
    _write(console / TLS_CERT_FILE, data.console_tls_cert, 0o644)
    if secrets.web_session_key is not None:
        _write(console / WEB_SESSION_KEY_FILE, secrets.web_session_key + "\n", 0o400, owner)
    if data.database_ca:
        _write(root / Path(DATABASE_CA_PATH).name, data.database_ca, 0o644)
