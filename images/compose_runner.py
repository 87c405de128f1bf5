"""Run a measured compose file with Debian's `docker-compose` (1.29.2, the one bookworm ships; the
CVM OS image and the tests install the same package).

The rendered files use three things 1.29 does not know: top-level `name`, `configs.content`
(compose v2.23+), and digest pins that a registry-less engine cannot resolve. The measured bytes
stay exactly as rendered (they are what RTMR3 holds); this module *lowers* them, deterministically
and without adding anything, into a file 1.29 runs:

- `name` becomes the project name (`-p`);
- each `configs.<n>.content` is written to `STATE/configs/<n>` (0444) and every service's
  `configs: [{source, target}]` becomes the read-only bind `STATE/configs/<n>:target:ro`;
- each `image: name@sha256:M` becomes the local image id whose archive's OCI manifest hashes to
  M (`umbra.images.image_store`); an unknown M is refused, nothing is pulled;
- a `runtime` the engine does not have is refused (the Security CVM's validator allows none);
- a bind of the TDX quote interface (`/sys/kernel/config/tsm/report`) on a machine without it is
  refused, unless the caller allowed it (`allow_missing_tsm`, development and CI): then it is
  dropped and said so (the service cannot quote, so it cannot enroll; a test hands over its
  credential instead).

Anything else in the file is passed through untouched, so the validator's guarantees
(`umbra.sandbox.validate`) carry over. The lowered file is written next to the configs for audit.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from umbra.sandbox.validate import TSM_REPORT, ComposeError, load_compose

COMPOSE = ("docker-compose",)


class ComposeRunError(Exception):
    """The compose file cannot be lowered or started; the message says which part and why."""


@dataclass(frozen=True)
class Lowered:
    project: str
    text: str  # the docker-compose 1.29 file
    configs: dict[str, str]  # config name -> content
    notes: tuple[str, ...]  # what the operator must know (e.g. a dropped quote mount)


def lower(
    compose: str,
    *,
    config_dir: Path,
    images: Mapping[str, str],
    runtimes: set[str],
    allow_missing_tsm: bool = False,
    tsm_present: bool = True,
) -> Lowered:
    try:
        doc = load_compose(compose)
    except ComposeError as exc:
        raise ComposeRunError(f"compose file: {exc}") from None
    project = doc.pop("name", None)
    if not isinstance(project, str) or not project:
        raise ComposeRunError("compose file: no top-level name (the project name)")
    configs: dict[str, str] = {}
    for name, spec in (doc.pop("configs", None) or {}).items():
        if not isinstance(spec, dict) or set(spec) != {"content"}:
            raise ComposeRunError(f"configs.{name}: only inline `content` configs are supported")
        configs[str(name)] = str(spec["content"])
    notes: list[str] = []
    for svc_name, svc in (doc.get("services") or {}).items():
        where = f"services.{svc_name}"
        ref = str(svc.get("image", ""))
        digest = ref.rpartition("@")[2]
        if digest not in images:
            raise ComposeRunError(f"{where}.image: {ref} is not loaded here (no registry pulls)")
        svc["image"] = images[digest]
        runtime = svc.get("runtime")
        if runtime is not None and runtime not in runtimes:
            raise ComposeRunError(f"{where}.runtime: {runtime} is not installed in the engine")
        if not tsm_present:
            kept = [v for v in svc.get("volumes") or [] if not str(v).startswith(TSM_REPORT)]
            if len(kept) != len(svc.get("volumes") or []):
                if not allow_missing_tsm:
                    raise ComposeRunError(
                        f"{where}.volumes: {TSM_REPORT} is absent: this machine is not a TDX "
                        "guest with configfs-tsm, so the service could not quote"
                    )
                svc["volumes"] = kept
                notes.append(f"{where}: no {TSM_REPORT} here, the mount is dropped (no quotes)")
        mounts = list(svc.pop("configs", None) or [])
        if mounts:
            volumes = list(svc.get("volumes") or [])
            for m in mounts:
                if not isinstance(m, dict) or m.get("source") not in configs or "target" not in m:
                    raise ComposeRunError(f"{where}.configs: want {{source, target}} of a config")
                volumes.append(f"{config_dir / m['source']}:{m['target']}:ro")
            svc["volumes"] = volumes
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    return Lowered(project, text, configs, tuple(notes))


def engine_runtimes(docker: str = "docker") -> set[str]:
    done = subprocess.run(
        [docker, "info", "--format", "{{json .Runtimes}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ComposeRunError(f"docker info: {done.stderr.strip() or 'no engine answers'}")
    try:
        return set(json.loads(done.stdout))
    except ValueError:
        raise ComposeRunError("docker info: runtimes are not JSON") from None


@dataclass(frozen=True)
class ComposeRunner:
    """`up`: lower, write, `docker-compose -p P -f F up --detach --no-build`."""

    state_dir: Path
    images: Mapping[str, str]
    allow_missing_tsm: bool = False
    argv: tuple[str, ...] = COMPOSE
    say: Callable[[str], None] = print

    def files(self, project: str) -> tuple[Path, Path]:
        base = self.state_dir / project
        return base / "configs", base / "docker-compose.lowered.yaml"

    def lower(self, compose: str) -> Lowered:
        project = str(load_compose(compose).get("name", ""))
        config_dir, _ = self.files(project or "unnamed")
        return lower(
            compose,
            config_dir=config_dir,
            images=self.images,
            runtimes=engine_runtimes(),
            allow_missing_tsm=self.allow_missing_tsm,
            tsm_present=Path(TSM_REPORT).is_dir(),
        )

    def up(self, compose: str) -> Lowered:
        low = self.lower(compose)
        config_dir, out = self.files(low.project)
        config_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        for name, content in low.configs.items():
            p = config_dir / name
            if p.exists():
                p.chmod(0o644)
            p.write_text(content)
            p.chmod(0o444)
        out.write_text(low.text)
        for note in low.notes:
            self.say(f"umbra-compose: {note}")
        self._run(low.project, out, "up", "--detach", "--no-build")
        return low

    def down(self, project: str) -> None:
        _, out = self.files(project)
        if not out.exists():
            return  # never brought up here
        self._run(project, out, "down", "--volumes", "--remove-orphans", "--timeout", "5")

    def _run(self, project: str, file: Path, *args: str) -> None:
        cmd = [*self.argv, "--ansi", "never", "-p", project, "-f", str(file), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        if done.returncode != 0:
            tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
            raise ComposeRunError(f"docker-compose {args[0]}: {tail or 'failed'}")
