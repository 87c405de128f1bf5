"""`umbra policy`: lint, test, diff, build, verify and publish the policy profiles in `policies/`.

Why one module: it is the one `umbra policy` Typer group; each command is an adapter over
umbra.policy (lint, test, diff, bundle, decide, suggest) sharing the loading and exit helpers here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer
from pydantic import BaseModel, ValidationError
from rich.table import Table

from umbra.cli.output import (
    EXIT_FINDINGS,
    EXIT_USAGE,
    console,
    fail,
    print_issues,
    print_json,
    stderr,
)
from umbra.contracts.files import write_atomic
from umbra.contracts.keys import KeyFileError, write_key_pair
from umbra.policy.body import decide_body
from umbra.policy.bundle import (
    BundleError,
    BundlePayload,
    SignedBundle,
    generate_key,
    load_private_key,
    load_public_key,
    payload_document,
    sign_bundle,
    verify_bundle,
)
from umbra.policy.diff import PolicyDiff, diff_policy_sets, load_at_revision
from umbra.policy.errors import PolicyError
from umbra.policy.fields import MAX_BODY_BYTES, BodyRequest
from umbra.policy.loader import PolicySet, load_policy_dir
from umbra.policy.matcher import decide_push
from umbra.policy.model import Profile
from umbra.policy.runner import run_suites
from umbra.policy.suite import CaseResult, Suite, parse_request

app = typer.Typer(help="Lint, test, diff, build and verify egress policy.", no_args_is_help=True)

PolicyDir = Annotated[Path, typer.Argument(help="The policy directory.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
DEFAULT_DIR = Path("policies")
SUGGEST_PAGES = 20  # at most 20,000 denials are read


def _exit_with_issues(exc: PolicyError, as_json: bool) -> NoReturn:
    if as_json:
        print_json({"ok": False, "issues": [issue.as_dict() for issue in exc.issues]})
    else:
        print_issues(exc.issues)
        stderr.print(f"{len(exc.issues)} problem(s); nothing was applied.", highlight=False)
    raise typer.Exit(EXIT_FINDINGS) from None


def _load(directory: Path, as_json: bool) -> PolicySet:
    try:
        return load_policy_dir(directory)
    except PolicyError as exc:
        _exit_with_issues(exc, as_json)


def _run(policy_set: PolicySet, as_json: bool) -> list[CaseResult]:
    try:
        return run_suites(policy_set)
    except PolicyError as exc:
        _exit_with_issues(exc, as_json)


@app.command()
def check(directory: PolicyDir = DEFAULT_DIR, as_json: JsonFlag = False) -> None:
    """Validate every profile and test suite; compose each suite's profiles."""
    policy_set = _load(directory, as_json)
    composed = []
    for suite in policy_set.suites:
        try:
            composed.append(
                (suite.suite.name, policy_set.compose(suite.suite.profiles, file=suite.file))
            )
        except PolicyError as exc:
            _exit_with_issues(exc, as_json)
    if as_json:
        print_json(
            {
                "ok": True,
                "profiles": {
                    name: _profile_summary(p.compiled)
                    for name, p in sorted(policy_set.profiles.items())
                },
                "compositions": {name: policy.hash for name, policy in composed},
            }
        )
        return
    table = Table(title=f"Profiles in {directory}")
    for column in ("profile", "allow", "deny", "tunnel", "scan", "inject", "file"):
        table.add_column(column)
    for name, loaded in sorted(policy_set.profiles.items()):
        summary = _profile_summary(loaded.compiled)
        table.add_row(
            name,
            *(str(summary[key]) for key in ("allow", "deny", "tunnel", "scan", "inject")),
            loaded.file,
        )
    console.print(table)
    console.print(
        f"[green]ok[/]: {len(policy_set.profiles)} profile(s), {len(policy_set.suites)} test suite(s)"
    )


def _profile_summary(profile: Any) -> dict[str, int]:
    return {
        "allow": sum(rule.action == "allow" for rule in profile.rules),
        "deny": sum(rule.action == "deny" for rule in profile.rules),
        "tunnel": len(profile.tunnels),
        "scan": len(profile.scan),
        "inject": len(profile.inject),
    }


@app.command("test")
def run_tests(directory: PolicyDir = DEFAULT_DIR, as_json: JsonFlag = False) -> None:
    """Run the test suites kept beside the profiles (request -> expected decision)."""
    results = _run(_load(directory, as_json), as_json)
    failed = [result for result in results if not result.passed]
    if as_json:
        print_json(
            {
                "ok": not failed,
                "passed": len(results) - len(failed),
                "failed": len(failed),
                "failures": [
                    {
                        "file": r.file,
                        "line": r.line,
                        "suite": r.suite,
                        "case": r.case,
                        "problems": list(r.problems),
                    }
                    for r in failed
                ],
            }
        )
    else:
        for result in failed:
            console.print(
                f"[red]FAIL[/] {result.file}:{result.line}: {result.case}: {'; '.join(result.problems)}",
                highlight=False,
                soft_wrap=True,
            )
        console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed", highlight=False)
    if failed:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def diff(
    rev_a: Annotated[str, typer.Argument(help="The base revision, e.g. origin/main.")],
    rev_b: Annotated[str, typer.Argument(help="The proposed revision, e.g. HEAD.")],
    directory: Annotated[
        str, typer.Option("--dir", help="Policy directory inside the repository.")
    ] = "policies",
    repo: Annotated[Path, typer.Option(help="The git repository.")] = Path("."),
    fail_on_widen: Annotated[
        bool,
        typer.Option("--fail-on-widen", help="Exit 1 when REV_B reaches anything REV_A could not."),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Show what the effective policy allows or denies differently between two git revisions."""
    try:
        before = load_at_revision(repo, rev_a, directory)
        after = load_at_revision(repo, rev_b, directory)
    except PolicyError as exc:
        _exit_with_issues(exc, as_json)
    result = diff_policy_sets(before, after)
    if as_json:
        print_json(_diff_json(result))
    else:
        _render_diff(result, rev_a, rev_b)
    if fail_on_widen and result.widens:
        raise typer.Exit(EXIT_FINDINGS)


def _diff_json(result: PolicyDiff) -> dict[str, Any]:
    return {
        "widens": result.widens,
        "profiles_added": result.profiles_added,
        "profiles_removed": result.profiles_removed,
        "added": [
            {"kind": c.kind, "grant": list(c.grant), "rule": c.rule_id} for c in result.added
        ],
        "removed": [
            {"kind": c.kind, "grant": list(c.grant), "rule": c.rule_id} for c in result.removed
        ],
        "decisions": [
            {"request": d.probe, "profiles": list(d.profiles), "before": d.before, "after": d.after}
            for d in result.decisions
        ],
    }


def _render_diff(result: PolicyDiff, rev_a: str, rev_b: str) -> None:
    if result.empty:
        console.print(f"No effective change between {rev_a} and {rev_b}.")
        return
    for name in result.profiles_added:
        console.print(f"[green]+ profile[/] {name}")
    for name in result.profiles_removed:
        console.print(f"[red]- profile[/] {name}")
    table = Table(title=f"Grants {rev_a} -> {rev_b}")
    for column in ("", "grant", "rule"):
        table.add_column(column)
    for change in result.added:
        table.add_row("[green]+[/]", change.describe(), change.rule_id)
    for change in result.removed:
        table.add_row("[red]-[/]", change.describe(), change.rule_id)
    if result.added or result.removed:
        console.print(table)
    if result.decisions:
        decisions = Table(title="Test requests whose decision changes")
        for column in ("request", "profiles", rev_a, rev_b):
            decisions.add_column(column)
        for decision in result.decisions:
            decisions.add_row(
                decision.probe,
                ",".join(decision.profiles) or "(none)",
                decision.before,
                decision.after,
            )
        console.print(decisions)
    verdict = "[bold yellow]widens egress[/]" if result.widens else "[bold]does not widen egress[/]"
    console.print(f"{rev_b} {verdict} relative to {rev_a}.")


@app.command()
def build(
    directory: PolicyDir = DEFAULT_DIR,
    sign_key: Annotated[
        list[Path], typer.Option("--sign-key", help="Ed25519 PEM private key (repeatable).")
    ] = [],  # noqa: B006 - typer reads the default, never mutates it
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Where to write the signed bundle.")
    ] = Path("bundle.json"),
    serial: Annotated[
        int | None, typer.Option(help="Release serial; default: the commit time of HEAD.", min=0)
    ] = None,
    source: Annotated[
        str | None, typer.Option(help="Recorded source; default: the git revision.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check and test the policy, then write a signed bundle of every compiled profile."""
    if not sign_key:
        fail("at least one --sign-key is required", EXIT_USAGE, as_json=as_json)
    policy_set = _load(directory, as_json)
    failed = [result for result in _run(policy_set, as_json) if not result.passed]
    if failed:
        fail(
            f"{len(failed)} policy test(s) fail; run `umbra policy test {directory}`",
            as_json=as_json,
        )
    try:
        keys = [load_private_key(path) for path in sign_key]
    except BundleError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    if serial is None:
        serial = _git_commit_time(directory)
        if serial is None:
            fail("not in a git repository: pass --serial", EXIT_USAGE, as_json=as_json)
    if source is None:
        source = _git_revision(directory)
    payload = payload_document([p.compiled for p in policy_set.profiles.values()], serial, source)
    signed = sign_bundle(payload, keys)
    write_atomic(output, signed, 0o644)
    verified = verify_bundle(signed, [key.public_key() for key in keys])
    summary = {
        "ok": True,
        "output": str(output),
        "hash": verified.hash,
        "serial": serial,
        "source": source,
    }
    summary["profiles"] = verified.profile_names()
    if as_json:
        print_json(summary)
    else:
        console.print(
            f"[green]wrote[/] {output}: {len(policy_set.profiles)} profile(s), serial {serial}, {verified.hash}"
        )


@app.command()
def verify(
    bundle: Annotated[Path, typer.Argument(help="A signed bundle file.")],
    key: Annotated[
        list[Path], typer.Option("--key", help="Pinned Ed25519 public key (repeatable).")
    ] = [],  # noqa: B006
    as_json: JsonFlag = False,
) -> None:
    """Verify a bundle's signature against pinned public keys and show what it holds."""
    try:
        keys = [load_public_key(path) for path in key]
        raw = bundle.read_bytes()
    except BundleError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    except OSError as exc:
        fail(f"{bundle}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    try:
        verified = verify_bundle(raw, keys)
    except BundleError as exc:
        fail(f"{bundle}: refused: {exc}", as_json=as_json)
    result = {
        "ok": True,
        "hash": verified.hash,
        "serial": verified.serial,
        "source": verified.payload.source,
        "signed_by": verified.keyid,
        "profiles": verified.profile_names(),
    }
    if as_json:
        print_json(result)
    else:
        console.print(
            f"[green]valid[/] {verified.hash}\n  serial {verified.serial}, source {verified.payload.source}\n"
            f"  signed by {verified.keyid}\n  profiles: {', '.join(verified.profile_names())}",
            highlight=False,
        )


@app.command()
def publish(
    bundle: Annotated[Path, typer.Argument(help="A signed bundle file (`umbra policy build`).")],
    team: Annotated[str | None, typer.Option("--team", help="Team (default: yours).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Upload a signed bundle to the Console as the team's current policy (admins). The release
    workflow calls this too; re-publishing the current bundle is a no-op."""
    import httpx

    from umbra.cli.auth import api_failure, open_client, resolve_team
    from umbra.console.client import ConsoleApiError

    try:
        raw = bundle.read_bytes()
    except OSError as exc:
        fail(f"{bundle}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            info = client.upload_bundle(team_name, raw)
    except (ConsoleApiError, httpx.HTTPError) as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json(info.model_dump(mode="json"))
    else:
        console.print(
            f"published serial {info.serial} ({info.hash}) to {team_name}: "
            f"{', '.join(info.profiles)}",
            highlight=False,
        )


@app.command()
def suggest(
    cvm: Annotated[str, typer.Option("--cvm", help="The CVM whose denials to draft from.")],
    since: Annotated[
        str, typer.Option(help="Denials newer than 15m, 2h, 7d or an ISO time.")
    ] = "2h",
    name: Annotated[
        str | None, typer.Option(help="Profile name (default: suggested-<cvm>).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Write profiles/NAME.yaml and tests/NAME.yaml under this directory."),
    ] = None,
    team: Annotated[str | None, typer.Option("--team", help="Team (default: yours).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Draft a profile (YAML with rule ids and comments) from a CVM's denials, narrowest first,
    with a test suite of the requests it was drafted from, for review in a pull request. Nothing
    is allowed until it is merged, signed and published."""
    from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team
    from umbra.cli.logs import parse_since
    from umbra.policy.suggest import Denial, draft

    try:
        start = parse_since(since)
    except ValueError:
        fail(f"--since {since!r}: use 15m, 2h, 7d or an ISO 8601 time", EXIT_USAGE, as_json=as_json)
    profile_name = name or ("suggested-" + re.sub(r"[^a-z0-9-]+", "-", cvm.lower())).strip("-")[:64]
    try:
        Profile.model_validate({"apiVersion": "umbra/v1", "kind": "Profile", "name": profile_name})
    except ValidationError:
        fail(
            f"--name {profile_name!r}: lowercase letters, digits and '-', 1 to 64",
            EXIT_USAGE,
            as_json=as_json,
        )
    client, login = open_client(as_json)
    denials: list[Denial] = []
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            cursor: str | None = None
            for _ in range(SUGGEST_PAGES):
                page = client.traffic(
                    team_name, cvm_id=cvm, decision="deny", since=start, limit=1000, cursor=cursor
                )
                for r in page.records:
                    host = r.connect_host or (r.host or "").rsplit(":", 1)[0]
                    if r.kind != "http" or not r.method or not host or r.port is None:
                        continue
                    scheme = "https" if r.sni else "http"
                    denials.append(
                        Denial(r.method, scheme, host, r.port, r.path or "/", r.reason or "")
                    )
                cursor = page.next_cursor
                if cursor is None:
                    break
    except api_errors() as exc:
        api_failure(exc, as_json)
    result = draft(
        profile_name, denials, f"the denials of CVM {cvm} since {start:%Y-%m-%d %H:%M} UTC"
    )
    written: list[str] = []
    if out is not None:
        for sub, text in (("profiles", result.profile), ("tests", result.suite)):
            if not text:
                continue
            target = out / sub / f"{profile_name}.yaml"
            if target.exists():
                fail(
                    f"{target} exists; choose another --name or --out", EXIT_USAGE, as_json=as_json
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, text, 0o644)
            written.append(str(target))
    if as_json:
        print_json(
            {"profile": result.profile, "suite": result.suite, "rules": result.rules,
             "skipped": result.skipped, "written": written}
        )  # fmt: skip
        return
    if out is None:
        console.print(result.profile, highlight=False, markup=False, end="")
        if result.suite:
            console.print("---\n" + result.suite, highlight=False, markup=False, end="")
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    console.print(
        f"{result.rules} rule(s) drafted from {len(denials)} denial(s); review before merging.",
        highlight=False,
    )


@app.command()
def keygen(
    path: Annotated[
        Path, typer.Argument(help="Private key file to create (the public key goes to PATH.pub).")
    ],
) -> None:
    """Create an Ed25519 release key pair for signing bundles."""
    try:
        public = write_key_pair(generate_key(), path)
    except KeyFileError as exc:
        fail(str(exc), EXIT_USAGE)
    console.print(f"[green]created[/] {path} (keep it secret) and {public} (pin this one)")


@app.command()
def decide(
    request: Annotated[
        str, typer.Argument(help="'METHOD URL', e.g. 'GET https://pypi.org/simple/'.")
    ],
    directory: PolicyDir = DEFAULT_DIR,
    profile: Annotated[
        list[str], typer.Option("--profile", "-p", help="Compose these (default: all).")
    ] = [],  # noqa: B006
    push: Annotated[
        list[str],
        typer.Option("--push", help="The request is a git push changing this ref (repeatable)."),
    ] = [],  # noqa: B006
    body: Annotated[
        str | None,
        typer.Option(
            "--body",
            metavar="FILE|-",
            help="The request's body (a file, or - for stdin), checked against body/mcp rules.",
        ),
    ] = None,
    content_type: Annotated[
        str, typer.Option("--content-type", help="Content-Type of the --body.")
    ] = "application/json",
    as_json: JsonFlag = False,
) -> None:
    """Show the decision the composed policy makes for one request."""
    try:
        probe = parse_request(request)
    except ValueError as exc:
        fail(f"request: {exc}", EXIT_USAGE, as_json=as_json)
    if body is not None and push:
        fail("--body and --push describe two different requests", EXIT_USAGE, as_json=as_json)
    raw = _read_body(body, as_json) if body is not None else b""
    policy_set = _load(directory, as_json)
    try:
        policy = policy_set.compose(profile or sorted(policy_set.profiles))
    except PolicyError as exc:
        _exit_with_issues(exc, as_json)
    decision = policy.decide(probe.method, probe.scheme, probe.host, probe.port, probe.path)
    if push:
        decision = decide_push(decision, push)
    if decision.field_rules:
        # as the proxy and `policy test` decide it: on the body given (none: an empty one)
        query = probe.path.partition("?")[2]
        types = (content_type,) if body is not None else ()
        decision = decide_body(decision, BodyRequest(types, raw, query, probe.method))
    injected = [
        placement
        for rule in policy.applicable_injections(probe.host, probe.port, decision)
        for placement in rule.placements
    ]
    result = {
        "verdict": str(decision.verdict),
        "reason": str(decision.reason),
        "rule": decision.rule_id,
        "host": decision.host,
        "path": decision.path,
        "detail": decision.detail,
        "inject": injected,
        "policy": policy.hash,
    }
    if as_json:
        print_json(result)
    else:
        color = "green" if decision.allowed else "red"
        console.print(
            f"[bold {color}]{decision.verdict}[/] {probe} — {decision.reason}"
            f"{' by ' + decision.rule_id if decision.rule_id else ''}"
            f"{'; injects ' + ', '.join(injected) if injected else ''}",
            highlight=False,
        )


def _read_body(source: str, as_json: bool) -> bytes:
    """The body from a file or stdin, read to one byte past the limit (so an oversized one is
    refused by the limit, never loaded whole)."""
    try:
        if source == "-":
            return typer.get_binary_stream("stdin").read(MAX_BODY_BYTES + 1)
        with Path(source).open("rb") as handle:
            return handle.read(MAX_BODY_BYTES + 1)
    except OSError as exc:
        fail(f"--body {source}: {exc.strerror or exc}", EXIT_USAGE, as_json=as_json)


@app.command()
def schema(
    kind: Annotated[
        Literal["profile", "test", "bundle", "signed-bundle"], typer.Option(help="Which document.")
    ] = "profile",
) -> None:
    """Print the JSON Schema of a policy document, for editors and linters."""
    models: dict[str, type[BaseModel]] = {
        "profile": Profile,
        "test": Suite,
        "bundle": BundlePayload,
        "signed-bundle": SignedBundle,
    }
    document = models[kind].model_json_schema(by_alias=True)
    document["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    print_json(document)


def _git_commit_time(directory: Path) -> int | None:
    out = _git(directory, "log", "-1", "--format=%ct")
    return int(out) if out and out.isdigit() else None


def _git_revision(directory: Path) -> str | None:
    revision = _git(directory, "rev-parse", "HEAD")
    if revision is None:
        return None
    dirty = _git(directory, "status", "--porcelain", "--", ".")
    return revision + ("-dirty" if dirty else "")


def _git(directory: Path, *args: str) -> str | None:
    try:
        completed = subprocess.run(
            ["git", "-C", str(directory), *args], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        return None
    return completed.stdout.strip() if completed.returncode == 0 else None
