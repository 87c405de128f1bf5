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
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


KEYRING_SERVICE = "umbra-console"
REFRESH_MARGIN = 60


def _keyring() -> Any | None:
    """The OS keyring (python `keyring`, when installed and backed by a real store), else None."""
    if os.environ.get("UMBRA_NO_KEYRING"):
        return None
    try:
        import keyring  # type: ignore[import-not-found,unused-ignore]
        from keyring.backends import fail  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        if isinstance(keyring.get_keyring(), fail.Keyring):
            return None
    except Exception:  # a broken keyring backend means: no keyring
        return None
    return keyring


def save_login(login: Login) -> Path:
    path = login_path()
    ring = _keyring()
    stored = login
    if ring is not None:
        secret = json.dumps({"token": login.token, "refresh_token": login.refresh_token})
        try:
            ring.set_password(KEYRING_SERVICE, login.url, secret)
            stored = login.model_copy(update={"token": "", "refresh_token": None, "keyring": True})
        except Exception:  # keyring refused: the 0600 file it is
            stored = login.model_copy(update={"keyring": False})
    write_private(path, stored.model_dump_json())
    return path


def read_login() -> Login:
    path = login_path()
    try:
        login = Login.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise LoginMissing("not logged in: run `umbra auth login URL`") from None
    except (OSError, ValidationError):
        raise LoginMissing(f"{path} is unreadable: run `umbra auth login URL` again") from None
    if login.keyring:
        ring = _keyring()
        raw = ring.get_password(KEYRING_SERVICE, login.url) if ring is not None else None
        if not raw:
            raise LoginMissing("the keyring holds no token: run `umbra auth login URL`")
        secret = json.loads(raw)
        login = login.model_copy(
            update={"token": secret.get("token", ""), "refresh_token": secret.get("refresh_token")}
        )
    if not login.token:
        raise LoginMissing(f"{path} holds no token: run `umbra auth login URL`")
    return login


def forget_login() -> None:
    path = login_path()
    try:
        login = Login.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        login = None
    ring = _keyring()
    if login is not None and login.keyring and ring is not None:
        with contextlib.suppress(Exception):
            ring.delete_password(KEYRING_SERVICE, login.url)
    path.unlink(missing_ok=True)


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
