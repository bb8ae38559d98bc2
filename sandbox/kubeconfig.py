"""Kubeconfig files for the sandbox's users (admin, controllers, kwok)."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from cacheroute.sandbox.pki import KeyPair

CONTEXT = "cacheroute-sandbox"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_kubeconfig(path: Path, *, server: str, ca_pem: bytes, client: KeyPair, user: str) -> Path:
    """A self-contained kubeconfig (certificates embedded) whose current context is the sandbox."""
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)}}],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert_pem),
                    "client-key-data": _b64(client.key_pem),
                },
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)
    return path
