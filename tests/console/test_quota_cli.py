"""`umbra quota show|set` and `umbra machine-types` through the real CLI against a running
Console: an admin sets limits, a developer reads them and is refused setting them (by the
Console's 403, in the CLI's `error: … / fix: …` style), launches over a disk quota are refused
with the quota named, on both backends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.console.helpers import Team, unique
from tests.console.test_cli_admin import Cli

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl dev"


def _login(team: Team, home: Path, client: Any) -> Cli:
    cli = Cli(home)
    token = str(client.headers["Authorization"]).removeprefix("Bearer ")
    cli("auth", "login", team.server.url, "--token-file", "-", "--team", team.name, input=token)
    return cli


def test_quota_commands(team: Team, tmp_path: Path) -> None:
    admin = _login(team, tmp_path / "admin", team.admin)
    dev = _login(team, tmp_path / "dev", team.dev)

    # Nothing set yet: no limits, and no catalog.
    empty = dev.json("quota", "show")
    assert empty["max_dev_cvms_per_owner"] is None and empty["machine_types"] == []
    assert "no machine-type catalog" in dev("machine-types").stdout

    done = admin.json(
        "quota", "set", "--max-cvms-per-developer", "3", "--machine-types", "small, large",
        "--min-data-disk-gb", "20", "--max-data-disk-gb", "100",
        "--max-data-disk-gb-per-developer", "150", "--max-data-disk-gb-total", "500",
    )  # fmt: skip
    assert done["machine_types"] == ["large", "small"] and done["max_data_disk_gb_total"] == 500
    # Limits not named keep their value; `none` removes one.
    again = admin.json("quota", "set", "--max-data-disk-gb-total", "none")
    assert again["max_data_disk_gb_total"] is None and again["max_dev_cvms_per_owner"] == 3

    shown = dev.json("quota", "show")
    assert shown["max_data_disk_gb_per_owner"] == 150 and shown["updated_by"] == team.admin_subject
    table = dev("quota", "show").stdout
    assert "data disk per developer" in table and "150 GB" in table and "20-100 GB" in table
    catalog = dev.json("machine-types")
    assert catalog == {"team": team.name, "machine_types": ["large", "small"],
                       "min_data_disk_gb": 20, "max_data_disk_gb": 100}  # fmt: skip
    listed = dev("machine-types").stdout
    assert "large" in listed and "small" in listed and "20-100 GB" in listed

    # A developer may read but not set: the Console says no, the CLI says who may.
    refused = dev("quota", "set", "--max-cvms-per-developer", "9", code=1)
    assert "error: console answered 403" in refused.stderr
    assert f"fix: only an admin of team '{team.name}' sets its quotas" in refused.stderr
    as_json = json.loads(dev("quota", "set", "--max-cvms-per-developer", "9", "--json",
                             code=1).stdout)  # fmt: skip
    assert as_json["ok"] is False and "403" in as_json["error"] and "admin" in as_json["fix"]
    bad = admin("quota", "set", "--max-data-disk-gb-total", "lots", code=2)
    assert "error: --max-data-disk-gb-total: 'lots' is neither a whole number nor 'none'" in (
        bad.stderr
    )
    assert "fix: " in bad.stderr
    upside_down = admin("quota", "set", "--min-data-disk-gb", "200", code=2)
    assert "min_data_disk_gb 200 is above max_data_disk_gb 100" in upside_down.stderr
    assert admin("quota", "set", code=2).stderr.startswith("error: nothing to change")

    # Launch and grow with a data disk size, refused over the developer's disk quota.
    key = tmp_path / "id.pub"
    key.write_text(KEY + "\n")
    launched = dev.json("cvm", "launch", unique("c"), "--ssh-key", str(key), "--size", "small",
                        "--data-disk-gb", "100")  # fmt: skip
    assert launched["data_disk_gb"] == 100
    over = dev("cvm", "launch", unique("c"), "--ssh-key", str(key), "--data-disk-gb", "60", code=1)
    assert "console answered 409: quota: max_data_disk_gb_per_owner" in over.stderr
    assert "use 100 GB of 150 GB" in over.stderr
    small = dev("cvm", "launch", unique("c"), "--ssh-key", str(key), "--data-disk-gb", "5", code=1)
    assert "below the team's minimum of 20 GB" in small.stderr
    grown = dev.json("cvm", "update", launched["id"], "--data-disk-gb", "100")
    assert grown["data_disk_gb"] == 100
    assert dev.json("quota", "show")["usage"]["data_disk_gb"] == 100
