"""The demo's sequence: install, apply, two phases around the switch to Auto, the replay's
prediction; the figures gathered in one `DemoRun` for the report and the plots."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cacheroute.planner.plan import Plan
from cacheroute.planner.plan_format import decode_plan
from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.demo import cluster
from cacheroute.sandbox.demo.cluster import DemoError, await_true, condition
from cacheroute.sandbox.demo.observe import PoolMetrics, router_ready_endpoints
from cacheroute.sandbox.demo.phases import PhaseResult, Progress, guard_rejected, run_phase, switch_to_auto
from cacheroute.sandbox.demo.prediction import PhasePrediction, predict
from cacheroute.sandbox.demo.settings import DemoSettings
from cacheroute.sandbox.demo.workload import DemoWorkload, demo_workload
from cacheroute.sandbox.loadgen.schedule import Schedule

Say = Callable[[str], None]
ProgressFactory = Callable[[str, int], contextlib.AbstractContextManager[Progress]]


@dataclass
class DemoRun:
    settings: DemoSettings
    workload: DemoWorkload
    phases: list[PhaseResult] = field(default_factory=list)
    plan: Plan | None = None
    plan_object: dict[str, Any] = field(default_factory=dict)
    kv_capacity_tokens: int = 0
    destination_ids: tuple[str, ...] = ()
    prediction: tuple[PhasePrediction, PhasePrediction] | None = None
    warmups: list[PhaseResult] = field(default_factory=list)
    # When each send (warm-up, p2c, warm-up, planned) began, in seconds after the first began.
    offsets_s: tuple[float, ...] = ()
    tables: dict[str, list[list[str]]] = field(default_factory=dict)
    steps_s: dict[str, float] = field(default_factory=dict)

    @property
    def guard_rejected(self) -> bool:
        """The operator's guard kept the candidate out: the second phase ran without a plan."""
        return bool(self.plan_object) and guard_rejected(self.plan_object)


@contextlib.contextmanager
def _no_progress(_name: str, _total: int) -> Any:
    yield None


def run_demo(
    sandbox: Sandbox, settings: DemoSettings, workload: DemoWorkload | None = None, say: Say = lambda _m: None,
    progress: ProgressFactory = _no_progress,
) -> DemoRun:
    """The whole sequence on a running sandbox (the workload is generated when not given)."""
    api = sandbox.api_client()
    run = DemoRun(settings, workload or demo_workload(settings))
    step = time.monotonic()

    def done(name: str) -> None:
        nonlocal step
        now = time.monotonic()
        run.steps_s[name] = round(now - step, 1)
        step = now

    say(f"helm install {settings.release} helm/cacheroute (namespace {settings.namespace}, "
        f"Prometheus {sandbox.prometheus.url})")
    cluster.adopt_crds(api, settings)
    cluster.helm_install(sandbox, settings, sandbox.prometheus.url)
    done("helm install")
    say(f"applying examples/demo: InferencePool {settings.pool} ({settings.destinations} destinations), "
        f"AffinityPlan {settings.plan} (Shadow)")
    cluster.apply(api, cluster.demo_manifests(settings))
    pool = cluster.await_pool_ready(api, settings)
    run.kv_capacity_tokens = int(pool["status"]["memoryPlan"]["kvCapacityTokens"])
    run.destination_ids = tuple(d["id"] for d in pool["status"]["destinations"])
    model = pool["spec"]["model"]["name"]
    await_true(lambda: bool(cluster.router_addresses(api, settings)), "a ready router pod", settings.step_timeout_s)
    routers = cluster.router_addresses(api, settings)
    await_true(lambda: all(router_ready_endpoints(a) == settings.destinations for a in routers),
               f"the router to see {settings.destinations} ready endpoints", settings.step_timeout_s)
    done("pool ready")
    metrics = PoolMetrics(sandbox.prometheus.url, settings.namespace, settings.pool)


    def send(name: str, schedule: Schedule) -> PhaseResult:
        with progress(name, len(schedule.requests)) as bar:
            return run_phase(name, schedule, router=routers[0], model=model, metrics=metrics,
                             destinations=settings.destinations, progress=bar)

    first, second = run.workload.rounds
    following = ", following prefixes, scoring the rest" if settings.follow_prefixes else ""
    say(f"no plan (Shadow: key-seeded p2c{following}): {len(first.warmup.requests)} requests of warm-up "
        f"over {settings.warmup_s:.0f} s, then {len(first.measured.requests)} measured over {settings.phase_s:.0f} s, "
        f"to the router at {routers[0]}")
    run.warmups.append(send("warm-up (p2c)", first.warmup))
    run.phases.append(send("p2c", first.measured))
    done("phase p2c")
    judged = "the guard replays the candidate" if settings.guard else "no guard (spec.guard.enabled false)"
    say(f"AffinityPlan mode Auto: the operator plans from the metrics of the first phase, {judged}, the router "
        "loads the plan")
    run.plan_object = switch_to_auto(api, settings, routers, window_s=time.time() - run.warmups[0].started_at)
    run.plan = published_plan(api, settings)
    done("plan published")
    status = run.plan_object["status"]
    if run.guard_rejected:
        say(f"the guard rejected the candidate ({condition(run.plan_object, 'Applied').get('message')}): the same "
            "slice again under the plan in effect (none), as the operator left it")
    else:
        say(f"planned (plan {status['planVersion']}, {status.get('admittedKeys')} keys): the same slice again "
            "(other text, same keys)")
    run.warmups.append(send("warm-up (planned)", second.warmup))
    run.phases.append(send("planned", second.measured))
    done("phase planned")
    sends = [run.warmups[0], run.phases[0], run.warmups[1], run.phases[1]]
    run.offsets_s = tuple(p.started_at - sends[0].started_at for p in sends)
    say("replaying the same requests on the same fleet (shadow replay)")
    schedules = [first.warmup, first.measured, second.warmup, second.measured]
    run.prediction = predict(list(zip(schedules, run.offsets_s, strict=True)), run.plan,
                             kv_capacity_tokens=run.kv_capacity_tokens, destination_ids=run.destination_ids,
                             measured=(1, 3), switch=2, follow_prefixes=settings.follow_prefixes)
    done("replay")
    for plural in ("inferencepools", "affinityplans"):
        run.tables[plural] = cluster.kubectl_get(api, settings.namespace, plural)
    return run


def published_plan(api: Any, settings: DemoSettings) -> Plan:
    """The plan in the pool's ConfigMaps, as its routers assemble it."""
    from kubernetes import client

    files: dict[str, bytes] = {}
    prefix = f"{settings.pool}-plan"
    for cm in client.CoreV1Api(api).list_namespaced_config_map(settings.namespace).items:
        name = cm.metadata.name
        if name == prefix or (name.startswith(prefix + "-") and name.rsplit("-", 1)[1].isdigit()):
            for file, data in (cm.binary_data or {}).items():
                files[file] = base64.b64decode(data)
    if not files:
        raise DemoError(f"no plan ConfigMap {prefix} in namespace {settings.namespace}")
    return decode_plan(files)


def teardown(sandbox: Sandbox, settings: DemoSettings) -> None:
    """Delete the plan and the pool while the operator still runs (their finalizers), then the release."""
    from kubernetes import client

    api = sandbox.api_client()
    custom = client.CustomObjectsApi(api)
    for plural, name in (("affinityplans", settings.plan), ("inferencepools", settings.pool)):
        with contextlib.suppress(client.ApiException):
            custom.delete_namespaced_custom_object(cluster.GROUP, cluster.VERSION, settings.namespace, plural, name)

    def gone() -> bool:
        for plural in ("affinityplans", "inferencepools"):
            items = custom.list_namespaced_custom_object(cluster.GROUP, cluster.VERSION, settings.namespace,
                                                         plural)["items"]
            if items:
                return False
        return True

    with contextlib.suppress(DemoError):
        await_true(gone, "the demo's pool and plan to be deleted", 120)
    with contextlib.suppress(DemoError):
        cluster.helm_uninstall(sandbox, settings)
