"""The operator's configuration file refuses what the API server or the kubelet would refuse later."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheroute.operator.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engine: {shmSizeLimit: lots}", "engine.shmSizeLimit: 'lots' is not a quantity (such as 500m, 2, 256Mi, 1Gi)"),
        ("engine: {memoryRequest: -5Gi}", "engine.memoryRequest: '-5Gi' is not a quantity"),
        ("engine: {cpuRequest: 2 cores}", "engine.cpuRequest: '2 cores' is not a quantity"),
        ("engine: {cpuRequest: -1}", "engine.cpuRequest: '-1' is not a quantity"),
        ("engine: {readinessPath: v1/models}", "engine.readinessPath: 'v1/models' is not a URL path (starting with /)"),
        ("router: {image: 'my image:1'}", "router.image: 'my image:1' is not an image reference"),
        ("router: {resources: {requests: {cpu: banana}}}",
         "router.resources: requests.cpu 'banana' is not a quantity"),
        ("router: {envoy: {resources: {limits: [1Gi]}}}",
         "router.envoy.resources: limits must be a mapping of resource name to quantity"),
        ("clusterDomain: ''", "clusterDomain: '' is not a DNS domain (such as cluster.local)"),
        ("clusterDomain: Cluster_Local", "clusterDomain: 'Cluster_Local' is not a DNS domain"),
        ("router: {envoy: {messageTimeout: 0s}}",
         "router.envoy.messageTimeout: '0s' is not a duration longer than 0 (such as 500ms, 5s)"),
        ("engine: {drainSeconds: 200}",
         "engine: drainSeconds (200) must be shorter than terminationGracePeriodSeconds (130): the kubelet kills"),
        ("router: {drainSeconds: 10, terminationGracePeriodSeconds: 10}",
         "router: drainSeconds (10) must be shorter than terminationGracePeriodSeconds (10)"),
    ],
)
def test_values_kubernetes_would_refuse_are_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "operator.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value).startswith(f"config {path}: {message}")
    assert "should match pattern" not in str(refused.value) and "Value error" not in str(refused.value)


def test_whole_numbers_are_quantities_and_every_form_the_api_server_takes_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "operator.yaml"
    path.write_text("engine: {cpuRequest: 8, memoryRequest: 68719476736, shmSizeLimit: 1.5Gi}\n"
                    "router: {resources: {requests: {cpu: 1500m, memory: 1e9}, limits: {memory: 2G, cpu: 0.5}}}\n"
                    "clusterDomain: corp.example\n")
    config = load_config(path)
    assert (config.engine.cpu_request, config.engine.memory_request) == ("8", "68719476736")
    assert config.engine.shm_size_limit == "1.5Gi"
    assert config.router.resources == {"requests": {"cpu": "1500m", "memory": "1e9"},
                                       "limits": {"memory": "2G", "cpu": 0.5}}
    assert config.cluster_domain == "corp.example"


def test_a_key_given_twice_and_broken_yaml_are_refused_at_their_line_in_the_file(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text('engine:\n  cpuRequest: "4"\n  cpuRequest: "8"\n')
    with pytest.raises(ConfigError, match=r"duplicate key 'cpuRequest' in \".*twice.yaml\", line 3"):
        load_config(twice)
    broken = tmp_path / "broken.yaml"
    broken.write_text("engine: [\n")
    with pytest.raises(ConfigError, match=r"in \".*broken.yaml\", line 2"):
        load_config(broken)


def test_a_fractional_number_is_a_quantity() -> None:
    from cacheroute.operator.config import EngineDefaults

    assert EngineDefaults.model_validate({"cpuRequest": 0.5}).cpu_request == "0.5"
