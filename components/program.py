"""The Pulumi program bodies: read and validate the stack config, then build a team (network,
Security CVM, Dev CVMs) or the Console. `infra/__main__.py` only calls `run`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
from pulumi.runtime import config as runtime_config

from umbra.components.config import (
    CONSOLE_DB_PASSWORD_KEY,
    CONSOLE_TLS_KEY_KEY,
    CONSOLE_WEB_SESSION_KEY_KEY,
    ConfigError,
    ConsoleStack,
    CvmConfig,
    StackConfig,
    TeamStack,
    parse_stack_config,
)
from umbra.components.cvm import (
    SECURITY_DATA_DISK_GB,
    DevCvm,
    DevCvmArgs,
    Placement,
    SecurityCvm,
    SecurityCvmArgs,
)
from umbra.components.launch_data import placeholder_app_compose
from umbra.components.naming import Owner, dev_cvm_name, security_cvm_name
from umbra.components.network import (
    TeamNetwork,
    TeamNetworkArgs,
    security_cvm_ip,
    security_replica_ip,
)
from umbra.components.ports import (
    COST_CENTRE_LABEL,
    ROLE_DEV,
    ROLE_LABEL,
    ROLE_SECURITY,
    TEAM_LABEL,
)
from umbra.components.security_pool import build_azure_security_lb, build_gcp_security_lb

BUILD = Path("images") / "build"


def read_runtime_config() -> tuple[dict[str, str], frozenset[str]]:
    """Every config value the engine handed this program, and which of them are secrets."""
    raw: dict[str, str] = {str(k): str(v) for k, v in runtime_config.get_config_env().items()}
    raw.update({str(k): str(v) for k, v in runtime_config.CONFIG.get().items()})
    secret = set(runtime_config.get_config_secret_keys_env())
    secret.update(k for k in raw if runtime_config.is_config_secret(k))
    return raw, frozenset(secret)


def load_stack_config() -> StackConfig:
    raw, secret = read_runtime_config()
    return parse_stack_config(raw, secret)


@dataclass(frozen=True)
class LaunchFiles:
    app_compose: str
    measurement_manifest: str | None
    placeholder: bool


def read_launch_files(root: Path, cvm: CvmConfig, role: str, where: str) -> LaunchFiles:
    """app-compose.json and the manifest digest from the release directory named in config, else
    from images/build/<role>, else a placeholder (marked in the document and the outputs)."""
    directory = root / (cvm.release_dir or BUILD / role)
    compose = directory / "app-compose.json"
    manifest = directory / "measurement-manifest.json"
    if not compose.is_file():
        if cvm.release_dir:
            raise ConfigError(
                f"umbra:stack.{where}.release_dir: {cvm.release_dir} has no app-compose.json "
                "(write it with `umbra image measure DEF --out DIR`)"
            )
        return LaunchFiles(placeholder_app_compose(role), cvm.measurement_manifest, True)
    ref = cvm.measurement_manifest
    if ref is None and manifest.is_file():
        ref = "sha256:" + hashlib.sha256(manifest.read_bytes()).hexdigest()
    # Bytes as written: the hash the release manifest pins is over exactly these.
    return LaunchFiles(compose.read_bytes().decode(), ref, placeholder=False)


@dataclass
class Team:
    network: TeamNetwork
    security: SecurityCvm
    security_replicas: list[SecurityCvm] = field(default_factory=list)
    console_url: pulumi.Input[str] = ""
    console_ca: pulumi.Input[str] | None = None
    dev_cvms: dict[str, dict[str, DevCvm]] = field(default_factory=dict)


def console_endpoint(
    cfg: TeamStack,
) -> tuple[pulumi.Input[str], pulumi.Input[str] | None]:
    """The Console's URL and TLS CA: from config, or from the Console stack's outputs."""
    if cfg.console_stack is None:
        assert cfg.console_url is not None  # the config requires exactly one
        return cfg.console_url, None
    ref = pulumi.StackReference(
        f"console-{cfg.console_stack.replace('/', '-')}", stack_name=cfg.console_stack
    )
    return ref.require_output("console_url"), ref.get_output("console_ca_pem")


def placement_for(
    cfg: TeamStack | ConsoleStack, resource_group: pulumi.Input[str] | None
) -> Placement:
    if cfg.gcp is not None:
        return Placement(cloud="gcp", project=cfg.gcp.project, zone=cfg.gcp.zone)
    assert cfg.azure is not None
    return Placement(
        cloud="azure",
        location=cfg.azure.location,
        zone=cfg.azure.zone,
        resource_group_name=resource_group,
    )


DEFAULT_DEV_DATA_DISK_GB = 100
NO_CONSOLE_TLS_WARNING = (
    "umbra:stack.tls_cert_file is unset: the Console VM's launch data has no TLS certificate or "
    "key, and its launch agent refuses to start the Console (set tls_cert_file and the secret "
    "umbra:consoleTlsKey)"
)
NO_CONSOLE_IPS_WARNING = (
    "umbra:stack.console_ips is empty: Dev CVMs cannot enroll at the Console (their forwarder "
    "has no DNS and the team network opens tcp 443 only to these addresses), so they get no "
    "tunnel credential; set console_ips to the Console's address(es)"
)


def build_team(cfg: TeamStack, root: Path) -> Team:
    net_cfg = cfg.network
    labels = {COST_CENTRE_LABEL: cfg.cost_centre} if cfg.cost_centre else {}
    network = TeamNetwork(
        cfg.team,
        TeamNetworkArgs(
            team=cfg.team,
            cloud=cfg.cloud,
            dev_cidr=str(net_cfg.dev_cidr),
            security_cidr=str(net_cfg.security_cidr),
            ssh_ingress_cidrs=[str(c) for c in net_cfg.ssh_ingress_cidrs],
            console_cidrs=[str(c) for c in net_cfg.console_cidrs],
            dev_console_ips=[str(ip) for ip in cfg.console_ips],
            gcp=cfg.gcp,
            azure=cfg.azure,
            labels=labels,
            security_dns_resolvers=[str(a) for a in net_cfg.security_dns_resolvers],
            log_denied=net_cfg.log_denied,
            reachability=net_cfg.reachability,
            iap_members=list(net_cfg.iap_members),
            bastion_cidr=str(net_cfg.bastion_cidr) if net_cfg.bastion_cidr else None,
            security_replicas=cfg.security_cvm.replicas,
        ),
    )
    place = placement_for(cfg, network.resource_group_name)
    sec_files = read_launch_files(root, cfg.security_cvm, ROLE_SECURITY, "security_cvm")
    console_url, console_ca = console_endpoint(cfg)
    replicas = cfg.security_cvm.replicas
    lb_ip = security_cvm_ip(str(net_cfg.security_cidr))
    pool: pulumi.Output[str] | None = None
    if replicas > 1 and cfg.azure is not None:
        assert network.resource_group_name is not None
        pool = build_azure_security_lb(
            cfg.team,
            prefix=f"umbra-{cfg.team}",
            resource_group=network.resource_group_name,
            location=cfg.azure.location,
            subnet_id=network.security_subnet_id,
            lb_ip=lb_ip,
            tags={**labels, TEAM_LABEL: cfg.team, ROLE_LABEL: ROLE_SECURITY},
            opts=pulumi.ResourceOptions(depends_on=[network]),
        )
    # Each replica is its own Console identity: its CVM id (launch-bound, in its quotes) and its
    # one-time token (a Pulumi secret: encrypted in state, and so is the metadata it joins).
    cvm_ids = cfg.security_cvm.cvm_ids or []
    tokens = cfg.security_enrollment_tokens()
    if not cvm_ids:
        pulumi.log.warn(
            "security_cvm.cvm_ids is unset: the Security CVMs get no enrollment token and cannot "
            "obtain their Console credential (register each replica with `umbra cvm "
            "security-replica I`)"
        )
    securities = [
        SecurityCvm(
            f"{cfg.team}-security" + (f"-{i}" if i else ""),
            SecurityCvmArgs(
                team=cfg.team,
                vm_name=security_cvm_name(cfg.team, i),
                placement=place,
                size=cfg.security_cvm.size,
                image=cfg.security_cvm.image,
                disk_gb=cfg.security_cvm.disk_gb,
                subnet_id=network.security_subnet_id,
                identity=network.security_identity,
                app_compose=sec_files.app_compose,
                measurement_manifest=sec_files.measurement_manifest,
                private_ip=security_replica_ip(str(net_cfg.security_cidr), i, replicas),
                dns_resolvers=tuple(str(a) for a in net_cfg.security_dns_resolvers),
                labels=labels,
                data_disk_gb=cfg.security_cvm.data_disk_gb or SECURITY_DATA_DISK_GB,
                # GCP's passthrough LB delivers to the LB address: a local route on the guest.
                lb_ip=lb_ip if replicas > 1 and cfg.gcp is not None else "",
                lb_backend_pool=pool,
                console_url=console_url,
                console_ca=console_ca,
                cvm_id=cvm_ids[i] if cvm_ids else "",
                enrollment_token=tokens[i] if tokens else None,
            ),
            opts=pulumi.ResourceOptions(depends_on=[network]),
        )
        for i in range(replicas)
    ]
    security = securities[0]
    if replicas > 1 and cfg.gcp is not None:
        build_gcp_security_lb(
            cfg.team,
            prefix=f"umbra-{cfg.team}",
            project=cfg.gcp.project,
            region=cfg.gcp.region,
            zone=cfg.gcp.zone,
            network_id=network.network_id,
            subnet_id=network.security_subnet_id,
            lb_ip=lb_ip,
            instances=[s.self_link for s in securities if s.self_link is not None],
            opts=pulumi.ResourceOptions(),
        )
    team = Team(
        network=network,
        security=security,
        security_replicas=securities,
        console_url=console_url,
        console_ca=console_ca,
    )
    console_ips = [str(ip) for ip in cfg.console_ips]
    dev_files = read_launch_files(root, cfg.dev_cvm, ROLE_DEV, "dev_cvm")
    unenrolled = [f"{d.name}/{c}" for d in cfg.developers for c in d.cvms if c not in d.cvm_ids]
    if unenrolled:
        pulumi.log.warn(
            f"developers[].cvm_ids has no Console id for {', '.join(unenrolled)}: those Dev "
            "CVMs get no enrollment token and their forwarder cannot get a tunnel credential "
            "(register each at the Console and set cvm_ids and umbra:devEnrollmentToken-<dev>-<cvm>)"
        )
    for dev in cfg.developers:
        for cvm in dev.cvms:
            team.dev_cvms.setdefault(dev.name, {})[cvm] = DevCvm(
                f"{cfg.team}-{dev.name}-{cvm}",
                DevCvmArgs(
                    team=cfg.team,
                    vm_name=dev_cvm_name(cfg.team, dev.name, cvm, Owner.TEAM_STACK),
                    placement=place,
                    size=dev.size or cfg.dev_cvm.size,
                    image=cfg.dev_cvm.image,
                    disk_gb=cfg.dev_cvm.disk_gb,
                    subnet_id=network.dev_subnet_id,
                    identity=network.dev_identity,
                    app_compose=dev_files.app_compose,
                    measurement_manifest=dev_files.measurement_manifest,
                    developer=dev.name,
                    # The Console's id (measured as umbra.cvm-id) and one-time token, when set.
                    cvm_id=dev.cvm_ids.get(cvm, ""),
                    enrollment_token=cfg.dev_enrollment_token(dev.name, cvm),
                    ssh_authorized_keys=dev.ssh_keys,
                    security_cvm_ips=network.security_cvm_ip.apply(lambda ip: [ip]),
                    console_url=console_url,
                    console_ca=console_ca,
                    console_ips=console_ips,
                    labels=labels,
                    data_disk_gb=cfg.dev_cvm.data_disk_gb or DEFAULT_DEV_DATA_DISK_GB,
                ),
                opts=pulumi.ResourceOptions(depends_on=[security]),
            )
    if not cfg.console_ips:
        pulumi.log.warn(NO_CONSOLE_IPS_WARNING)
    for role, files in ((ROLE_SECURITY, sec_files), (ROLE_DEV, dev_files)):
        if files.placeholder:
            pulumi.log.warn(
                f"{role}: no release found; using a PLACEHOLDER compose that no verifier accepts "
                f"(`umbra image measure DEF --out {BUILD / role}` writes the real one)"
            )
    return team


def export_team(cfg: TeamStack, team: Team) -> None:
    net = team.network
    pulumi.export("team", cfg.team)
    pulumi.export("cloud", cfg.cloud)
    pulumi.export("console_url", team.console_url)
    # What a Console-launched Dev CVM's forwarder needs to enroll (automation.build_dev_cvm).
    pulumi.export("console_ca_pem", team.console_ca or "")
    pulumi.export("console_ips", [str(ip) for ip in cfg.console_ips])
    placement = cfg.gcp.model_dump() if cfg.gcp else cfg.azure.model_dump() if cfg.azure else {}
    pulumi.export("placement", placement)
    pulumi.export("network_id", net.network_id)
    pulumi.export("dev_subnet_id", net.dev_subnet_id)
    pulumi.export("security_cvm_ip", net.security_cvm_ip)
    if net.dev_identity is not None:
        pulumi.export("dev_identity", net.dev_identity)
    if net.resource_group_name is not None:
        pulumi.export("resource_group_name", net.resource_group_name)
    # The address the internet sees for this team's egress (allow-list it where needed).
    pulumi.export("security_egress_ip", net.egress_ip)
    pulumi.export("security_cvm_compose_sha256", team.security.compose_sha256)
    pulumi.export(
        "dev_cvms",
        {
            dev: {
                name: {
                    "private_ip": cvm.private_ip,
                    "compose_sha256": cvm.compose_sha256,
                    "ssh_keys_sha256": cvm.ssh_keys_sha256,
                    "expected_events": cvm.expected_events,
                }
                for name, cvm in cvms.items()
            }
            for dev, cvms in team.dev_cvms.items()
        },
    )


def build_console(cfg: ConsoleStack, root: Path) -> None:
    from umbra.components.console_service import ConsoleService, ConsoleServiceArgs

    raw, _ = read_runtime_config()
    password = pulumi.Output.secret(raw[CONSOLE_DB_PASSWORD_KEY])
    files = read_launch_files(root, cfg.vm, "console", "vm")
    tls_cert: str | None = None
    if cfg.tls_cert_file:
        cert = root / cfg.tls_cert_file
        if not cert.is_file():
            raise ConfigError(f"umbra:stack.tls_cert_file: {cfg.tls_cert_file} is not a file")
        tls_cert = cert.read_text()
    else:
        pulumi.log.warn(NO_CONSOLE_TLS_WARNING)
    console = ConsoleService(
        cfg.name,
        ConsoleServiceArgs(
            name=cfg.name,
            cloud=cfg.cloud,
            gcp=cfg.gcp,
            azure=cfg.azure,
            cidr=str(cfg.cidr),
            ingress_cidrs=[str(c) for c in cfg.ingress_cidrs],
            vm_size=cfg.vm.size,
            vm_image=cfg.vm.image,
            console_image=cfg.console_image,
            app_compose=files.app_compose,
            db_tier=cfg.db_tier,
            db_password=password,
            db_storage_gb=cfg.db_storage_gb,
            team_projects=list(cfg.team_projects),
            state_bucket=cfg.state_bucket,
            team_resource_groups=list(cfg.team_resource_groups),
            state_scope=cfg.state_scope,
            tls_cert=tls_cert,
            tls_key=pulumi.Output.secret(raw[CONSOLE_TLS_KEY_KEY]) if tls_cert else None,
            web_session_key=(
                pulumi.Output.secret(raw[CONSOLE_WEB_SESSION_KEY_KEY])
                if CONSOLE_WEB_SESSION_KEY_KEY in raw
                else None
            ),
            replicas=cfg.replicas,
            dev_state=cfg.dev_state,
        ),
    )
    # What team stacks read through their StackReference (`console_stack`).
    if cfg.url:
        pulumi.export("console_url", cfg.url)
    if cfg.tls_ca_file:
        ca = root / cfg.tls_ca_file
        if not ca.is_file():
            raise ConfigError(f"umbra:stack.tls_ca_file: {cfg.tls_ca_file} is not a file")
        pulumi.export("console_ca_pem", ca.read_text())
    pulumi.export("database_ca_pem", console.database_ca_pem)
    pulumi.export("console_private_ip", console.private_ip)
    pulumi.export("console_public_ip", console.public_ip)
    pulumi.export("database_url", console.database_url)
    if console.dev_state_backend_url is not None and console.dev_secrets_provider is not None:
        # The Console's settings: <cloud>.state_backend_url and <cloud>.secrets_provider.
        pulumi.export("dev_state_backend_url", console.dev_state_backend_url)
        pulumi.export("dev_secrets_provider", console.dev_secrets_provider)


def run(root: Path) -> None:
    """Program entry: a bad config ends the run with its message and no traceback."""
    try:
        cfg = load_stack_config()
        if isinstance(cfg, TeamStack):
            export_team(cfg, build_team(cfg, root))
        else:
            build_console(cfg, root)
    except ConfigError as exc:
        raise pulumi.RunError(f"stack configuration is invalid:\n{exc}") from None
