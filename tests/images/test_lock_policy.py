"""How a build holds its rootfs to a package lock (images.lock_policy): strict for releases; the
test suite's `security-updates` policy accepts a newer version of a locked package only from the
codename's -security/-updates/point suite, as the rootfs's own apt indices say, and reports it.
Fast: synthetic lock/got maps and a synthetic var/lib/apt/lists, no build."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from umbra.images.build import BuildError, BuildResult, check_lock
from umbra.images.lock_policy import Drift, LockPolicy, Origins, apt_origins, judge
from umbra.images.oci import BuiltImage
from umbra.images.os_image import OsImage
from umbra.images.os_lock import check_os_lock
from umbra.images.provenance import statement
from umbra.images.recipes import Rootfs

from . import conftest

ROOT = Path(__file__).resolve().parents[2]
LOCKED = {"openssl": "3.5.9-1~deb13u1", "bash": "5.2.37-2"}
SECURITY = "3.5.10-1~deb13u1"
STRICT, TOLERANT = LockPolicy.STRICT, LockPolicy.SECURITY_UPDATES


def _release(codename: str, suite: str) -> str:
    return (
        "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA512\n\nOrigin: Debian\n"
        f"Suite: {suite}\nCodename: {codename}\nSHA256:\n abc 1 main/Packages\n"
    )


def _stanzas(*pairs: tuple[str, str]) -> str:
    return "".join(f"Package: {p}\nArchitecture: amd64\nVersion: {v}\n\n" for p, v in pairs)


def apt_lists(root: Path, indices: dict[str, list[tuple[str, str]]]) -> Path:
    """A rootfs whose var/lib/apt/lists holds, for each codename, the Release file and one
    Packages index as apt names them (deb.debian.org_debian[-security]_dists_CODENAME_…)."""
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    suites = {"trixie": "stable", "trixie-updates": "stable-updates",
              "trixie-security": "stable-security", "trixie-backports": "stable-backports"}  # fmt: skip
    for codename, pairs in indices.items():
        archive = "debian-security" if codename.endswith("-security") else "debian"
        base = f"deb.debian.org_{archive}_dists_{codename}_"
        (lists / f"{base}InRelease").write_text(_release(codename, suites[codename]))
        (lists / f"{base}main_binary-amd64_Packages").write_text(_stanzas(*pairs))
    return root


def _origins_of(root: Path) -> Callable[[set[tuple[str, str]]], Origins]:
    return lambda wanted: apt_origins(root, wanted)


def test_the_indices_name_the_suite_of_each_version(tmp_path: Path) -> None:
    root = apt_lists(
        tmp_path,
        {
            "trixie": [("openssl", "3.5.9-1~deb13u1"), ("bash", "5.2.37-2")],
            "trixie-updates": [("tzdata", "2025c-0+deb13u1")],
            "trixie-security": [("openssl", SECURITY)],
            "trixie-backports": [("linux-base", "4.13~bpo13+1")],
        },
    )
    wanted = {("openssl", SECURITY), ("tzdata", "2025c-0+deb13u1"), ("linux-base", "4.13~bpo13+1"),
              ("bash", "9.9-9")}  # fmt: skip
    assert apt_origins(root, wanted) == {
        ("openssl", SECURITY): frozenset({"trixie-security"}),
        # "…_dists_trixie_" is not a prefix of "…_dists_trixie-updates_…": each index its own.
        ("tzdata", "2025c-0+deb13u1"): frozenset({"trixie-updates"}),
        ("linux-base", "4.13~bpo13+1"): frozenset({"trixie-backports"}),
    }


def test_a_security_update_is_accepted_tolerantly_and_refused_strictly(tmp_path: Path) -> None:
    root = apt_lists(tmp_path, {"trixie": [], "trixie-security": [("openssl", SECURITY)]})
    got = LOCKED | {"openssl": SECURITY}
    accepted, problems = judge(
        got, LOCKED, policy=TOLERANT, codename="trixie", origins=_origins_of(root)
    )
    assert problems == []
    assert accepted == [Drift("openssl", "3.5.9-1~deb13u1", SECURITY, "trixie-security")]

    asked: list[object] = []
    accepted, problems = judge(
        got, LOCKED, policy=STRICT, codename="trixie", origins=lambda w: asked.append(w) or {}
    )
    assert accepted == []
    assert problems == [f"openssl: locked 3.5.9-1~deb13u1, got {SECURITY}"]
    assert asked == []  # strict never looks at the indices


def test_a_point_release_or_updates_version_is_accepted(tmp_path: Path) -> None:
    root = apt_lists(
        tmp_path,
        {"trixie": [("bash", "5.2.37-2+deb13u1")], "trixie-updates": [("openssl", SECURITY)]},
    )
    got = {"bash": "5.2.37-2+deb13u1", "openssl": SECURITY}
    accepted, problems = judge(
        got, LOCKED, policy=TOLERANT, codename="trixie", origins=_origins_of(root)
    )
    assert problems == []
    assert [(d.package, d.suite) for d in accepted] == [
        ("bash", "trixie"),
        ("openssl", "trixie-updates"),
    ]


@pytest.mark.parametrize(
    ("got", "indices", "want"),
    [
        # A downgrade, even one the security suite offers.
        ({"openssl": "3.5.8-1"}, {"trixie-security": [("openssl", "3.5.8-1")]},
         "openssl: locked 3.5.9-1~deb13u1, got 3.5.8-1 (not newer than the lock"),
        # Newer, but only backports offers it.
        ({"openssl": "3.6.0-1~bpo13+1"}, {"trixie-backports": [("openssl", "3.6.0-1~bpo13+1")]},
         "(from trixie-backports, not trixie-security / trixie-updates / trixie)"),
        # Newer, and no index of this build lists it at all.
        ({"openssl": SECURITY}, {"trixie": []},
         "(from no apt index of this build, not trixie-security"),
    ],
)  # fmt: skip
def test_other_drift_is_refused_tolerantly_too(
    tmp_path: Path, got: dict[str, str], indices: dict[str, list[tuple[str, str]]], want: str
) -> None:
    root = apt_lists(tmp_path, indices)
    accepted, problems = judge(
        LOCKED | got, LOCKED, policy=TOLERANT, codename="trixie", origins=_origins_of(root)
    )
    assert accepted == []
    assert len(problems) == 1 and want in problems[0], problems


def test_the_refusal_lists_packages_in_name_order() -> None:
    got = {"openssl": "2", "openssl-provider-legacy": "2"}
    _, problems = judge(got, dict.fromkeys(got, "1"), policy=STRICT, codename="trixie",
                        origins=lambda _w: {})  # fmt: skip
    assert problems == ["openssl: locked 1, got 2", "openssl-provider-legacy: locked 1, got 2"]


def test_a_new_or_missing_package_is_refused_by_both_policies(tmp_path: Path) -> None:
    root = apt_lists(tmp_path, {"trixie-security": [("tini", "0.19.0-1")]})
    got = {"openssl": LOCKED["openssl"], "tini": "0.19.0-1"}  # bash gone, tini new
    for policy in LockPolicy:
        accepted, problems = judge(
            got, LOCKED, policy=policy, codename="trixie", origins=_origins_of(root)
        )
        assert accepted == []
        assert problems == [
            "bash: locked 5.2.37-2, not installed",
            "tini: 0.19.0-1 installed but not in the lock",
        ]


def test_the_builds_report_and_return_each_accepted_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = (
        f"lock drift accepted: openssl 3.5.9-1~deb13u1 -> {SECURITY} (trixie-security); "
        "refresh the lock with --update-lock"
    )
    os_root = apt_lists(tmp_path / "os", {"trixie-security": [("openssl", SECURITY)]})
    got = LOCKED | {"openssl": SECURITY}
    drift = check_os_lock("qemu", got, {"qemu": LOCKED}, policy=TOLERANT, root=os_root)
    assert [d.line() for d in drift] == [line]
    assert capsys.readouterr().err == line + "\n"
    with pytest.raises(BuildError, match=r"qemu: .*\(strict policy\):\n  openssl: locked"):
        check_os_lock("qemu", got, {"qemu": LOCKED}, root=os_root)  # strict by default

    # The container images' lock is bookworm's: trixie-security is another codename's suite.
    with pytest.raises(BuildError, match=r"\(from trixie-security, not bookworm-security / "):
        check_lock(Rootfs.RUNTIME, got, LOCKED, policy=TOLERANT, root=os_root)
    ct_root = tmp_path / "ct"
    lists = ct_root / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    base = "deb.debian.org_debian-security_dists_bookworm-security_"
    (lists / f"{base}InRelease").write_text(_release("bookworm-security", "oldstable-security"))
    (lists / f"{base}main_binary-amd64_Packages").write_text(_stanzas(("openssl", SECURITY)))
    capsys.readouterr()
    drift = check_lock(Rootfs.RUNTIME, got, LOCKED, policy=TOLERANT, root=ct_root)
    assert [d.suite for d in drift] == ["bookworm-security"]
    assert "lock drift accepted: openssl" in capsys.readouterr().err


def test_provenance_records_the_policy_and_the_versions_really_installed() -> None:
    digest = "sha256:" + "ab" * 32
    image = BuiltImage("proxy", digest, digest, digest, Path("proxy.docker.tar"))
    drift = [Drift("openssl", "3.5.9-1~deb13u1", SECURITY, "bookworm-security")]
    result = BuildResult(Rootfs.RUNTIME, 1700000000, [image], [], TOLERANT, drift)
    st = statement(result, source_repo="u", source_commit="c", builder_id="t", command=["x"])
    internal = st.predicate.buildDefinition.internalParameters
    assert internal["lock_policy"] == "security-updates"
    assert internal["lock_drift"] == [
        {"package": "openssl", "locked": "3.5.9-1~deb13u1", "installed": SECURITY,
         "suite": "bookworm-security"}
    ]  # fmt: skip
    strict = BuildResult(Rootfs.RUNTIME, 1700000000, [image], [])
    internal = statement(strict, source_repo="u", source_commit="c", builder_id="t",
                         command=["x"]).predicate.buildDefinition.internalParameters  # fmt: skip
    assert (internal["lock_policy"], internal["lock_drift"]) == ("strict", [])


def test_releases_are_strict_and_the_test_builds_are_tolerant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flow = yaml.safe_load((ROOT / ".github/workflows/release-images.yml").read_text())
    runs = [s.get("run", "") for job in flow["jobs"].values() for s in job["steps"]]
    assert any("image build" in r for r in runs) and any("image os-build" in r for r in runs)
    assert not any("--lock-policy" in r for r in runs)  # the CLI's default: strict

    import umbra.images.build as build

    seen: dict[str, object] = {}
    drift = [Drift("openssl", "1", "2", "bookworm-security")]
    digest = "sha256:" + "ab" * 32
    image = BuiltImage("proxy", digest, digest, digest, tmp_path / "proxy.docker.tar")

    def fake_rootfs(*_a: object, **kw: object) -> BuildResult:
        seen["runtime"] = kw["lock_policy"]
        return BuildResult(Rootfs.RUNTIME, 1, [image], [], TOLERANT, drift)

    def fake_os(*_a: object, **kw: object) -> OsImage:
        seen["os"] = kw["lock_policy"]
        return OsImage(tmp_path, tmp_path, tmp_path, tmp_path, tuple(drift))

    monkeypatch.setattr(build, "build_rootfs", fake_rootfs)
    monkeypatch.setattr(conftest, "build_os_image", fake_os)
    with pytest.warns(UserWarning, match="lock drift accepted: openssl 1 -> 2"):
        images = conftest.build_runtime(tmp_path, tmp_path / "w.whl", tmp_path / "r.txt")
    assert list(images) == ["proxy"]
    with pytest.warns(UserWarning, match="lock drift accepted: openssl 1 -> 2"):
        conftest.build_qemu_os(tmp_path, tmp_path / "w.whl", tmp_path / "r.txt", "stub")
    assert seen == {"runtime": TOLERANT, "os": TOLERANT}
    prov = json.loads((tmp_path / "provenance.runtime.intoto.json").read_text())
    internal = prov["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["lock_drift"] == [
        {"package": "openssl", "locked": "1", "installed": "2", "suite": "bookworm-security"}
    ]
