"""The API server as a pod sees it on a cluster: HTTPS at $KUBERNETES_SERVICE_HOST:PORT, and a
service account's token, CA certificate and namespace mounted at
/var/run/secrets/kubernetes.io/serviceaccount. Unmodified in-cluster clients (kopf and the
kubernetes client's load_incluster_config) log in with exactly these.

The emulator serves plain HTTP on the host's 127.0.0.1; this terminates TLS on the host's
address on the test's docker network (its gateway), with a certificate made for that address,
and pipes each connection to the emulator. Nothing listens anywhere else."""

from __future__ import annotations

import socket
import ssl
import subprocess
from pathlib import Path

from harness.network import _Forward

MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class InClusterAccess:
    def __init__(self, workdir: Path, address: str, api_port: int):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.address = address
        self.ca = self.workdir / "ca.crt"
        key = self.workdir / "tls.key"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-keyout",
                str(key),
                "-out",
                str(self.ca),
                "-subj",
                "/CN=kube-apiserver",
                "-addext",
                f"subjectAltName=IP:{address}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca, key)
        listener = context.wrap_socket(socket.create_server((address, 0)), server_side=True)
        self.port = listener.getsockname()[1]
        self._forward = _Forward(listener, ("127.0.0.1", api_port))

    def env(self) -> dict[str, str]:
        """What a kubelet puts in every container's env (from the `kubernetes` Service)."""
        return {"KUBERNETES_SERVICE_HOST": self.address, "KUBERNETES_SERVICE_PORT": str(self.port)}

    def account(self, namespace: str, name: str) -> Path:
        """The folder mounted at MOUNT in a pod of `namespace` running as account `name`."""
        folder = self.workdir / "accounts" / namespace / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "token").write_text(f"emulator-token-of-{namespace}-{name}")
        (folder / "namespace").write_text(namespace)
        (folder / "ca.crt").write_bytes(self.ca.read_bytes())
        for path in (folder, *folder.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        return folder

    def close(self) -> None:
        self._forward.close()
