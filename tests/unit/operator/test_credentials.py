"""kopf logs in with the credentials of the client the operator built from its --kubeconfig."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kopf._core.intents.causes import Activity  # kopf exports no name for it

from cacheroute.operator import context, runtime
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.credentials import connection_info
from cacheroute.operator.fleet.cluster import Cluster
from cacheroute.operator.work import PriorityExecutor

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def kubeconfig(path: Path, server: str, user: dict[str, Any], **cluster: Any) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path


def test_a_token_kubeconfig_gives_kopf_its_server_token_and_certificate_authority(tmp_path: Path) -> None:
    given = kubeconfig(tmp_path / "given", "https://10.1.2.3:6443", {"token": "s3cret"},
                       **{"certificate-authority-data": base64.b64encode(PEM.encode()).decode()})
    info = connection_info(runtime.api_client(given).configuration)
    assert info.server == "https://10.1.2.3:6443"
    assert (info.scheme, info.token) == ("Bearer", "s3cret")
    assert info.ca_path is not None and Path(str(info.ca_path)).read_text() == PEM
    assert info.insecure is False and info.certificate_path is None


def test_client_certificates_and_an_unverified_server_reach_kopf_as_files(tmp_path: Path) -> None:
    given = kubeconfig(tmp_path / "given", "https://10.9.9.9:443",
                       {"client-certificate-data": base64.b64encode(b"CERT").decode(),
                        "client-key-data": base64.b64encode(b"KEY").decode()},
                       **{"insecure-skip-tls-verify": True})
    info = connection_info(runtime.api_client(given).configuration)
    assert info.insecure is True and info.token is None
    assert info.certificate_path is not None and Path(str(info.certificate_path)).read_bytes() == b"CERT"
    assert info.private_key_path is not None and Path(str(info.private_key_path)).read_bytes() == b"KEY"


def test_kopf_logs_in_to_the_given_kubeconfig_not_the_one_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kubernetes library fixed its default kubeconfig when imported: the variable and the home
    # folder point elsewhere, and only the file given to the operator may count.
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "env", "https://10.0.0.1:1", {"token": "env"})))
    monkeypatch.setenv("HOME", str(tmp_path))
    given = kubeconfig(tmp_path / "given", "https://10.7.7.7:6443", {"token": "given"})
    context.set_context(context.OperatorContext(
        config=OperatorConfig(), cluster=Cluster(runtime.api_client(given)), work=PriorityExecutor(1)))
    runtime.load_handlers()
    registry = kopf.get_default_registry()
    handlers = registry._activities.get_handlers(activity=Activity.AUTHENTICATION)
    assert [h.id for h in handlers] == ["cacheroute-client"]
    login: Any = handlers[0].fn
    info = login(settings=kopf.OperatorSettings())
    assert (info.server, info.token) == ("https://10.7.7.7:6443", "given")
