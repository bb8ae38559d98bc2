"""kopf's credentials, taken from the kubernetes client the operator built.

kopf's own logins read the kubernetes library's default kubeconfig, a path that library fixes when
it is imported (`$KUBECONFIG` then, else `~/.kube/config`). With `--kubeconfig`, kopf therefore
watched the cluster of `~/.kube/config` while the operator's client wrote to the one given, and
with no `~/.kube/config` kopf could not log in at all. Deriving kopf's connection from the client's
configuration keeps both on one cluster with one identity, whichever way that client was
configured (the kubeconfig given, in-cluster credentials, `~/.kube/config`).
"""

from __future__ import annotations

from typing import Any

import kopf


def connection_info(configuration: Any, *, trust_env: bool = False) -> kopf.ConnectionInfo:
    """kopf's ConnectionInfo for a `kubernetes.client.Configuration`.

    The token is read through the configuration's API-key accessor, which runs its refresh hook:
    in-cluster, a rotated ServiceAccount token is read again when kopf logs in anew after a 401.
    """
    # Newer clients keep the bearer token under BearerToken, older ones under authorization.
    header = configuration.get_api_key_with_prefix("BearerToken") or configuration.get_api_key_with_prefix(
        "authorization"
    )
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0] if parts else None)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        proxy_url=configuration.proxy or None,
        trust_env=trust_env,
    )
