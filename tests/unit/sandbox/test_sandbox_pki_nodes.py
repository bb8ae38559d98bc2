"""Certificates, fake node manifests and Prometheus jobs, checked without starting servers."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cacheroute.sandbox import network, nodes
from cacheroute.sandbox.pki import CertificateAuthority
from cacheroute.sandbox.prometheus import ScrapeJob


def test_issued_certificate_chains_to_the_ca_with_names_and_usages() -> None:
    authority = CertificateAuthority()
    ca = x509.load_pem_x509_certificate(authority.keypair.cert_pem)
    pair = authority.issue("kube-apiserver", dns_names=("localhost",), ip_addresses=("127.0.0.1",), server=True)
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_client_certificate_carries_the_group_kubernetes_reads() -> None:
    pair = CertificateAuthority().issue("admin", organizations=("system:masters",), client=True)
    subject = x509.load_pem_x509_certificate(pair.cert_pem).subject
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "admin"


def test_certificate_must_have_a_purpose() -> None:
    with pytest.raises(ValueError, match="server, a client"):
        CertificateAuthority().issue("nobody")


def test_signing_key_is_p256() -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from cacheroute.sandbox.pki import signing_keypair

    key = load_pem_private_key(signing_keypair()[0], password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"


@pytest.mark.parametrize("pod_network", [network.LOCAL_NETWORK, network.LOOPBACK_NETWORK])
def test_node_pod_cidrs_split_the_pod_network_and_miss_the_node_address(pod_network: str) -> None:
    net = network.PodNetwork(pod_network, routed=False)
    cidrs = [ipaddress.IPv4Network(nodes.node_manifest(i, network=net)["spec"]["podCIDR"]) for i in range(8)]
    assert all(c.subnet_of(ipaddress.IPv4Network(pod_network)) and c.prefixlen == 24 for c in cidrs)
    assert len({c for c in cidrs}) == 8
    node_ips = [ipaddress.ip_address(nodes.node_ip(i)) for i in range(8)]
    assert not any(ip in c for ip in node_ips for c in cidrs)
    # Outside the loopback range, the EndpointSlice API accepts pod addresses.
    assert not ipaddress.IPv4Network(network.LOCAL_NETWORK).subnet_of(ipaddress.IPv4Network("127.0.0.0/8"))


def test_node_manifest_matches_gpu_feature_discovery() -> None:
    manifest = nodes.node_manifest(0)
    labels = manifest["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.memory"] == "81559"
    assert manifest["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert manifest["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    with pytest.raises(ValueError, match="node index 250"):
        nodes.node_manifest(250)


def test_scrape_job_validation() -> None:
    job = ScrapeJob("vllm", ["127.1.0.2:8000"], labels={"pool": "llama"})
    assert job.to_config()["static_configs"] == [{"targets": ["127.1.0.2:8000"], "labels": {"pool": "llama"}}]
    with pytest.raises(ValueError, match="name 'a b'"):
        ScrapeJob("a b", ["127.0.0.1:1"])
    with pytest.raises(ValueError, match="at least one target"):
        ScrapeJob("empty", [])
