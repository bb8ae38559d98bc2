"""The runtime loads every handler module of the package, so other concerns plug in by adding one."""

from __future__ import annotations

import kopf

from cacheroute.operator import context, runtime
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet.cluster import Cluster
from cacheroute.operator.work import PriorityExecutor


def test_every_handler_module_is_loaded_and_registers_pool_handlers() -> None:
    ctx = context.OperatorContext(config=OperatorConfig(), cluster=Cluster(None), work=PriorityExecutor(1))
    context.set_context(ctx)
    loaded = runtime.load_handlers()
    assert "pool" in loaded
    registry = kopf.get_default_registry()
    ids = {h.id for h in registry._changing.get_all_handlers()}  # kopf keeps no public listing
    assert {"pool_changed"} <= ids


def test_settings_keep_kopf_state_under_our_prefix_and_post_only_warnings() -> None:
    options = runtime.RunOptions(
        namespaces=("a",), all_namespaces=False, peering="cacheroute", standalone=False, priority=5,
        health_host="127.0.0.1", health_port=0, config=OperatorConfig(),
    )
    settings = runtime.settings_for(options)
    assert settings.persistence.finalizer == "cacheroute.dev/operator"
    assert settings.peering.priority == 5 and settings.peering.name == "cacheroute"
    assert settings.posting.level >= 30
