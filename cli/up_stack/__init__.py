"""`umbra up`'s machinery: the embedded stack as real processes supervised from a state directory.

    .umbra/
      up.lock            held while an `umbra up`/`down` runs (a second one is refused)
      state.json         ports, ids of the team's Security CVM and Dev CVM
      run/NAME.pid       one per component; each process carries UMBRA_UP_STATE=<dir> in its
                         environment, so a recycled pid is never mistaken for ours
      logs/NAME.log      stdout+stderr of each component; logs/up.log: each run's steps, timestamped
      keys/, pki/, ...   development keys, the simulated TEE's PKI, the demo origin's CA
      cvms/ID/           local Dev CVMs (sandbox/local_cvm.py)

Components: the development OIDC issuer, the Console (SQLite, migrated at start, embedded mode),
the Security CVM (`umbra proxy serve` with its aTLS tunnel endpoint on the simulated TEE) and the
walkthrough's stand-in origin. The Dev CVM is launched through the Console's API exactly as
`umbra cvm launch` does; the Console's local provider builds it.

One module a concern, re-exported here (callers import `umbra.cli.up_stack`):

    names       the team, user and hosts; Component, Port, Health
    errors      UpError (message and fix)
    supervise   Stack: state directory, lock, spawn/stop/reap, waits; the preflight
    upstream    --internet targets, a network's own mirrors, the upstream CA bundle
    material    keys, the simulated TEE's PKI and golden values, config files, SSH identity
    components  each component's argv and environment, and starting it
    seed        the Console seeded through its API (login, bundle, Security CVM, secrets)
    devcvm      the sandbox image, the Dev CVM's launch, the sandbox trusting the proxy's CA
    qemu        `--runtime qemu`: QEMU's preflight, KVM or TCG, the Dev release, the provider's
                config, the VMs (found, shown, stopped)
    os_disk     `--runtime qemu`: the qemu OS image's boot disk, built once per source tree
    status      `umbra status` probes and `umbra down`
"""

from __future__ import annotations

from umbra.cli.up_stack.components import (
    console_env,
    console_settings,
    proxy_argv,
    start_console,
    start_console_front,
    start_issuer,
    start_llm_origin,
    start_origin,
    start_pccs,
    start_proxy,
    wait_tunnel,
)
from umbra.cli.up_stack.devcvm import (
    DEFAULT_PROFILES,
    ensure_dev_cvm,
    ensure_sandbox_image,
    wait_sandbox_ca,
)
from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.material import (
    claude_oauth_token,
    llm_keys,
    prepare_material,
    save_client_opt_ins,
    ssh_identity,
    write_secret,
)
from umbra.cli.up_stack.names import (
    COMPONENTS,
    DEMO_HOSTS,
    DEMO_SECRET_NAME,
    DEV_CVM_NAME,
    LLM_HOST,
    PORTS,
    SECURITY_CVM_NAME,
    SIMULATED_IMAGE,
    SUBJECT,
    TEAM,
    VENDOR_ENV,
    VENDOR_HOSTS,
    Component,
    Health,
    Port,
)
from umbra.cli.up_stack.qemu import Runtime, runtime
from umbra.cli.up_stack.seed import (
    api,
    demo_profile,
    ensure_demo_secret,
    ensure_llm_secrets,
    ensure_secret,
    ensure_security_cvm,
    expect,
    login,
    publish_bundle,
    token,
)
from umbra.cli.up_stack.status import component_health, down, status
from umbra.cli.up_stack.supervise import REQUIRED_TOOLS, Stack, preflight, umbra_executable
from umbra.cli.up_stack.upstream import (
    DAILY_HOSTS,
    INTERNET_TARGETS,
    SYSTEM_CA_BUNDLES,
    internet_hosts,
    internet_targets,
)

__all__ = [
    "COMPONENTS",
    "DAILY_HOSTS",
    "DEFAULT_PROFILES",
    "DEMO_HOSTS",
    "DEMO_SECRET_NAME",
    "DEV_CVM_NAME",
    "INTERNET_TARGETS",
    "LLM_HOST",
    "PORTS",
    "REQUIRED_TOOLS",
    "SECURITY_CVM_NAME",
    "SIMULATED_IMAGE",
    "SUBJECT",
    "SYSTEM_CA_BUNDLES",
    "TEAM",
    "VENDOR_ENV",
    "VENDOR_HOSTS",
    "Component",
    "Health",
    "Port",
    "Runtime",
    "Stack",
    "UpError",
    "api",
    "claude_oauth_token",
    "component_health",
    "console_env",
    "console_settings",
    "demo_profile",
    "down",
    "ensure_demo_secret",
    "ensure_dev_cvm",
    "ensure_llm_secrets",
    "ensure_sandbox_image",
    "ensure_secret",
    "ensure_security_cvm",
    "expect",
    "internet_hosts",
    "internet_targets",
    "llm_keys",
    "login",
    "preflight",
    "prepare_material",
    "proxy_argv",
    "publish_bundle",
    "runtime",
    "save_client_opt_ins",
    "ssh_identity",
    "start_console",
    "start_console_front",
    "start_issuer",
    "start_llm_origin",
    "start_origin",
    "start_pccs",
    "start_proxy",
    "status",
    "token",
    "umbra_executable",
    "wait_sandbox_ca",
    "wait_tunnel",
    "write_secret",
]
