"""Where the CLI keeps its Console login and the SSH files it writes (no typer/rich: the
ProxyCommand imports this and must start fast)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from umbra.contracts.files import write_atomic


class Login(BaseModel):
    """A Console login. `token`/`refresh_token` live in the OS keyring when one exists (then
    `keyring: true` and the file holds neither), else in this 0600 file."""

    model_config = ConfigDict(extra="forbid")

    url: str
    token: str = Field(default="", repr=False)
    team: str | None = None
    refresh_token: str | None = Field(default=None, repr=False)
    expires_at: int | None = None  # unix seconds; refreshed silently a minute before
    token_endpoint: str | None = None
    client_id: str | None = None
    keyring: bool = False
    keyring_backend: str | None = None  # e.g. keyring.backends.SecretService.Keyring

    def __repr__(self) -> str:  # never show the token in tracebacks
        return f"Login(url={self.url!r}, team={self.team!r})"


class LoginMissing(Exception):
    """No usable stored login; the message says what to run."""


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "umbra"


def login_path() -> Path:
    return config_dir() / "console.json"


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Create-then-rename, mode 0600 from the start: never readable by others, never partial."""
    private_dir(path.parent)
    write_atomic(path, text, 0o600)


KEYRING_SERVICE = "umbra-console"
REFRESH_MARGIN = 60
NO_KEYRING_ENV = "UMBRA_NO_KEYRING"
_BACKENDS = "keyring.backends."


@dataclass(frozen=True)
class Stored:
    """Where `save_login` put the tokens: `keyring` names the backend, else the file holds them
    and `reason` says why no keyring was used."""

    path: Path
    keyring: str | None
    reason: str | None = None

    def describe(self) -> str:
        if self.keyring is not None:
            return f"tokens stored in the OS keyring ({self.keyring}); settings in {self.path}"
        return f"no usable OS keyring ({self.reason}): tokens stored in {self.path} (mode 0600)"


def _backend_name(backend: Any) -> str:
    return f"{type(backend).__module__}.{type(backend).__qualname__}"


def _keyring(recorded: str | None = None) -> tuple[Any | None, str]:
    """The OS keyring (python `keyring` with a real backend) and a name, or (None, why not).

    Imported only here and only when needed: a login stored in a keyring records its backend,
    and reading it loads that backend class directly (skipping keyring's entry-point scan)."""
    if os.environ.get(NO_KEYRING_ENV):
        return None, f"{NO_KEYRING_ENV} is set"
    try:
        if recorded is not None and recorded.startswith(_BACKENDS):
            import importlib

            module, _, cls = recorded.rpartition(".")
            backend = getattr(importlib.import_module(module), cls)()
        else:
            import keyring  # type: ignore[import-not-found,unused-ignore]
            from keyring.backends import fail  # type: ignore[import-not-found,unused-ignore]

            backend = keyring.get_keyring()
            if isinstance(backend, fail.Keyring):
                return None, "no keyring backend is available"
    except Exception as exc:  # a broken keyring means: no keyring
        return None, f"the keyring cannot be opened: {type(exc).__name__}"
    return backend, _backend_name(backend)


FREEDESKTOP_BACKEND = "keyring.backends.SecretService.Keyring"


def _secret_service_get(service: str, username: str) -> str | None:
    """keyring's SecretService lookup (same collection, same attributes), read with
    `secretstorage` alone: `import keyring` costs ~0.2-0.3 s, and every ProxyCommand reads the
    token; writes, refreshes and deletes still go through `keyring`."""
    if os.environ.get(NO_KEYRING_ENV):
        return None
    import secretstorage

    conn = secretstorage.dbus_init()
    try:
        collection = secretstorage.get_default_collection(conn)
        for item in collection.search_items({"username": username, "service": service}):
            if item.is_locked():
                item.unlock()
            return item.get_secret().decode()
        return None
    finally:
        conn.close()


def save_login(login: Login) -> Stored:
    """Tokens to the OS keyring when one works, else into the 0600 file; never partial."""
    path = login_path()
    ring, name = _keyring(login.keyring_backend if login.keyring else None)
    if ring is not None:
        secret = json.dumps({"token": login.token, "refresh_token": login.refresh_token})
        try:
            ring.set_password(KEYRING_SERVICE, login.url, secret)
        except Exception as exc:  # locked, dismissed, no collection: the 0600 file it is
            ring, name = None, f"the keyring refused to store: {type(exc).__name__}"
    if ring is not None:
        stored = login.model_copy(
            update={"token": "", "refresh_token": None, "keyring": True, "keyring_backend": name}
        )
        write_private(path, stored.model_dump_json())
        return Stored(path, name)
    write_private(path, login.model_copy(update={"keyring": False}).model_dump_json())
    return Stored(path, None, name)


def read_login() -> Login:
    path = login_path()
    try:
        login = Login.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise LoginMissing("not logged in: run `umbra auth login URL`") from None
    except (OSError, ValidationError):
        raise LoginMissing(f"{path} is unreadable: run `umbra auth login URL` again") from None
    if login.keyring:
        why = "it holds no token"
        try:
            if login.keyring_backend == FREEDESKTOP_BACKEND:
                raw = _secret_service_get(KEYRING_SERVICE, login.url)
            else:
                ring, why = _keyring(login.keyring_backend)
                raw = ring.get_password(KEYRING_SERVICE, login.url) if ring is not None else None
            secret = json.loads(raw) if raw else {}
        except Exception:  # a locked or vanished keyring: say so, never a traceback
            raise LoginMissing(
                "the OS keyring cannot be read: unlock it or run `umbra auth login URL`"
            ) from None
        if not isinstance(secret, dict) or not secret.get("token"):
            raise LoginMissing(f"the OS keyring: {why}: run `umbra auth login URL`")
        login = login.model_copy(
            update={"token": secret.get("token", ""), "refresh_token": secret.get("refresh_token")}
        )
    if not login.token:
        raise LoginMissing(f"{path} holds no token: run `umbra auth login URL`")
    return login


def forget_login() -> Path:
    path = login_path()
    try:
        login = Login.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        login = None
    if login is not None and login.keyring:
        ring, _ = _keyring(login.keyring_backend)
        if ring is not None:
            with contextlib.suppress(Exception):
                ring.delete_password(KEYRING_SERVICE, login.url)
    path.unlink(missing_ok=True)
    return path


def fresh_login(now: float | None = None) -> Login:
    """The stored login, its access token refreshed silently when it is about to expire.

    Raises LoginMissing("… run `umbra auth login` …") when the session has truly expired."""
    login = read_login()
    when = time.time() if now is None else now
    if login.expires_at is None or when < login.expires_at - REFRESH_MARGIN:
        return login
    if not (login.refresh_token and login.token_endpoint and login.client_id):
        raise LoginMissing("your Console session has expired: run `umbra auth login`")
    import httpx

    try:
        answer = httpx.post(
            login.token_endpoint,
            data={
                "grant_type": "refresh_token",
                "refresh_token": login.refresh_token,
                "client_id": login.client_id,
            },
            timeout=20,
        )
        body = answer.json()
    except (httpx.HTTPError, ValueError):
        raise LoginMissing("cannot refresh the Console session (issuer unreachable)") from None
    token = body.get("access_token") if answer.status_code == 200 else None
    if not isinstance(token, str) or not token:
        raise LoginMissing("your Console session has expired: run `umbra auth login`")
    refreshed = login.model_copy(
        update={
            "token": token,
            "refresh_token": body.get("refresh_token") or login.refresh_token,
            "expires_at": int(when) + int(body["expires_in"]) if "expires_in" in body else None,
        }
    )
    save_login(refreshed)
    return refreshed


# -- SSH: known_hosts written only from attested host keys -----------------------------------
def ssh_dir() -> Path:
    return config_dir() / "ssh"


def known_hosts_path() -> Path:
    return ssh_dir() / "known_hosts"


def host_alias(cvm_id: str) -> str:
    return f"umbra-{cvm_id}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    private_dir(path.parent)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


BOOT_COMMENT = "umbra-boot="


@dataclass(frozen=True)
class HostKeyPin:
    key: str  # `type base64`
    boot_id: str | None  # the attested boot the key was pinned for (None: an older pin)


class PinConflict(Exception):
    """The attested key differs from the pin for the same CVM and boot."""


def _pin_in(lines: list[str], alias: str) -> HostKeyPin | None:
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and fields[0] == alias:
            boots = [f[len(BOOT_COMMENT) :] for f in fields[3:] if f.startswith(BOOT_COMMENT)]
            return HostKeyPin(f"{fields[1]} {fields[2]}", boots[0] if boots else None)
    return None


def pinned_host_key(cvm_id: str) -> HostKeyPin | None:
    try:
        lines = known_hosts_path().read_text().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return _pin_in(lines, host_alias(cvm_id))


def pin_host_key(cvm_id: str, key: str, boot_id: str) -> bool:
    """Make `key` the only host key known for this CVM (read from a verified quote), recorded
    with the attested boot id as a known_hosts comment (ssh ignores it). Within one boot the key
    cannot change: raises PinConflict. Returns True when the pin changed (a new boot's key)."""
    path, alias = known_hosts_path(), host_alias(cvm_id)
    with _locked(path):
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        old = _pin_in(lines, alias)
        if old is not None and old.boot_id == boot_id:
            if old.key != key:
                raise PinConflict(f"boot {boot_id[:8]} of {cvm_id} was pinned with another key")
            return False
        kept = [line for line in lines if line.split(" ", 1)[0] != alias]
        write_private(path, "\n".join([*kept, f"{alias} {key} {BOOT_COMMENT}{boot_id}"]) + "\n")
        return old is not None and old.key != key


# -- `umbra up`'s local opt-ins ------------------------------------------------------------------
class EmbeddedClient(BaseModel):
    """What `umbra up` tells this client about the Console it started: its Dev CVMs run on a
    simulated TEE (trust its root, never for production) and log in with this SSH key. Applies
    only while the stored login is for exactly that Console; an environment variable wins."""

    model_config = ConfigDict(extra="forbid")

    console_url: str
    simulated_pki: str
    ssh_identity: str


def embedded_client_path() -> Path:
    return config_dir() / "embedded.json"


def save_embedded_client(settings: EmbeddedClient) -> None:
    write_private(embedded_client_path(), settings.model_dump_json(indent=2))


def embedded_client() -> EmbeddedClient | None:
    """The `umbra up` opt-ins, if the current login is for the Console `umbra up` started."""
    try:
        settings = EmbeddedClient.model_validate_json(embedded_client_path().read_text())
        url = json.loads(login_path().read_text()).get("url")
    except (OSError, ValueError, ValidationError):
        return None
    return settings if url == settings.console_url else None
