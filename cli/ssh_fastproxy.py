"""The fast ProxyCommand (`ProxyUseFdpass yes`): stdlib only, run as `python -S -I THIS CVM`.

Asks the warm agent (`umbra.cli.ssh_agent`, started on first use) to attest the CVM, receives a
socket carrying the verified session, and passes it to ssh over stdout; then exits. A refusal is
the same one line on stderr as `umbra ssh-proxy`, exit 1, and ssh never gets a socket. The agent
is keyed by the settings that decide trust (config dir, simulated PKI, PCCS), so two different
configurations never share one.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

KEYS = ("HOME", "XDG_CONFIG_HOME", "UMBRA_SIMULATED_PKI", "UMBRA_PCCS_URL", "UMBRA_NO_KEYRING")


def agent_path() -> str:
    base = os.path.join(
        os.environ.get("TMPDIR") or tempfile.gettempdir(), f"umbra-ssh-{os.getuid()}"
    )
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{base} must be a directory owned by you with mode 0700")
    key = hashlib.sha256(json.dumps([os.environ.get(k) for k in KEYS]).encode()).hexdigest()
    return os.path.join(base, f"agent-{key[:16]}.sock")


def connect(path: str, python: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except OSError:
        pass
    subprocess.Popen(
        [python, "-m", "umbra.cli.ssh_agent", path],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            s.connect(path)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def main() -> int:
    cvm = sys.argv[1] if len(sys.argv) == 2 else ""
    if not cvm:
        print("usage: ssh_fastproxy.py CVM", file=sys.stderr)
        return 2
    try:
        s = connect(agent_path(), sys.executable)
        s.sendall(json.dumps({"cvm": cvm}).encode() + b"\n")
        s.settimeout(60)
        msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
        reply = json.loads(msg.split(b"\n", 1)[0] or b"{}")
        if reply.get("ok") is not True or len(fds) != 1:
            line = reply.get("line") or "internal: the agent closed without an answer"
            print(f"umbra ssh-proxy: refused {cvm}: {line}", file=sys.stderr)
            return 1
        out = socket.socket(fileno=os.dup(1))  # ssh's end: a socket in ProxyUseFdpass mode
        socket.send_fds(out, [b"\0"], fds)  # OpenSSH reads exactly one byte with the fd
        return 0
    except (OSError, ValueError) as exc:
        print(
            f"umbra ssh-proxy: failed {cvm}: internal: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
