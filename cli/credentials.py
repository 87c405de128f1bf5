"""Where the CLI keeps its Console login and the SSH files it writes (no typer/rich: the
ProxyCommand imports this and must start fast)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    token: str
    team: str | None = None

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


def save_login(login: Login) -> Path:
    path = login_path()
    write_private(path, login.model_dump_json())
    return path


def read_login() -> Login:
    path = login_path()
    try:
        return Login.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise LoginMissing("not logged in: run `umbra auth login URL`") from None
    except (OSError, ValidationError):
        raise LoginMissing(f"{path} is unreadable: run `umbra auth login URL` again") from None


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


def pin_host_key(cvm_id: str, key: str) -> None:
    """Make `key` the only host key known for this CVM (it was read from a verified quote)."""
    path, alias = known_hosts_path(), host_alias(cvm_id)
    with _locked(path):
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        kept = [line for line in lines if line.split(" ", 1)[0] != alias]
        write_private(path, "\n".join([*kept, f"{alias} {key}"]) + "\n")
