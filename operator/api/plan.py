"""AffinityPlan: the routing policy of one pool (the schema source of its CRD).

Computed routes never go into spec, where GitOps tools would fight the operator over them: they
go into the plan ConfigMap, and a summary into status.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from cacheroute.operator.api.common import (
    API_VERSION,
    CONDITIONS_FIELD,
    ApiModel,
    Condition,
    CrossFieldRule,
    Duration,
    IntOrWords,
    ObjectMeta,
    enforce,
    parse_duration,
)

MAX_PINNED = 10_000
# The operator's control loop runs no faster than this; a shorter period would plan without pause.
MIN_CONTROL_PERIOD = "1s"
MAX_DESTINATIONS_PER_KEY = 16


class PoolRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, description="InferencePool in the same namespace.")


class PrometheusSpec(ApiModel):
    url: str | None = Field(default=None, max_length=2048, description="Defaults to the operator's --prometheus-url.")
    timeout: Duration = Field(default="10s", description="Each query gives up after this long.")


class BudgetSpec(ApiModel):
    """The warm-prefix budget: how much KV each destination keeps for planned keys."""

    warm_tokens_per_destination: Annotated[int | Literal["auto"], IntOrWords(ge=1)] = Field(
        default="auto", description="KV tokens per destination reserved for planned prefixes, or auto."
    )
    auto_fraction: float = Field(
        default=0.6, gt=0, le=1, description="With auto: this share of each destination's KV capacity."
    )
    max_destinations_per_key: int = Field(
        default=4, ge=1, le=MAX_DESTINATIONS_PER_KEY, description="Most destinations one hot key is spread over."
    )
    max_key_share_of_destination: float = Field(
        default=0.5, gt=0, le=1, description="A key needing more of a destination than this is replicated."
    )


class StabilitySpec(ApiModel):
    max_churn: float = Field(default=0.1, ge=0, le=1, description="Largest share of planned load one re-plan may move.")
    min_gain: float = Field(
        default=0.02, ge=0, le=1, description="Smallest predicted improvement that justifies a move."
    )


class GuardSpec(ApiModel):
    """Shadow-replay gate: a candidate plan is applied only if it meets these."""

    enabled: bool = Field(default=True, description="Replay each candidate before applying it.")
    p99_ttft: Duration = Field(default="3.5s", description="Service-level objective on p99 time to first token.")
    min_kv_hit_gain: float = Field(
        default=0.0, ge=-1, le=1, description="Required gain in served KV hit over routing without a plan."
    )
    replay_duration: Duration = Field(
        default="2m",
        description=(
            "Traffic replayed per verdict, synthesised from the window's statistics; the first half warms caches. "
            "Thin traffic is replayed longer, until 2,000 requests are measured (at most 30 minutes), and a "
            "verdict close to a limit is taken on the median of three such windows."
        ),
    )


class PinnedRoute(ApiModel):
    key: str = Field(min_length=1, max_length=1024, description="The affinity key as clients send it.")
    destinations: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        min_length=1,
        max_length=MAX_DESTINATIONS_PER_KEY,
        description="Destination ids, <pool>-<ordinal>, each once.",
        # The API server refuses a destination listed twice.
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    @model_validator(mode="after")
    def _each_destination_once(self) -> PinnedRoute:
        twice = sorted({d for d in self.destinations if self.destinations.count(d) > 1})
        if twice:
            raise ValueError(f"pinned key {self.key!r} lists {twice[0]} twice")
        return self


class AffinityPlanSpec(ApiModel):
    pool_ref: PoolRef
    mode: Literal["Auto", "Shadow", "Manual"] = Field(
        default="Auto",
        description="Auto plans and applies; Shadow plans and replays without applying; Manual applies pinned only.",
    )
    control_period: Duration = Field(default="5m", description="How often the operator re-plans.")
    metrics_window: Duration = Field(default="30m", description="How much history each plan reads.")
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec, description="Where the metrics come from.")
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    stability: StabilitySpec = Field(default_factory=StabilitySpec, description="Low-churn re-planning.")
    guard: GuardSpec = Field(default_factory=GuardSpec)
    pinned: list[PinnedRoute] = Field(
        default_factory=list,
        max_length=MAX_PINNED,
        description="Routes always honoured (Manual: the only ones); `cacheroute plan -o yaml` writes them.",
        # A list map keyed by `key`: the API server refuses a key pinned twice.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["key"]},
    )

    rules: ClassVar[tuple[CrossFieldRule, ...]] = (
        CrossFieldRule(
            cel=f"!has(self.controlPeriod) || duration(self.controlPeriod) >= duration('{MIN_CONTROL_PERIOD}')",
            message=f"controlPeriod must be at least {MIN_CONTROL_PERIOD}",
            check=lambda s: parse_duration(s.control_period) >= parse_duration(MIN_CONTROL_PERIOD),
            field_path=".controlPeriod",
        ),
        CrossFieldRule(
            cel="self.mode != 'Manual' || (has(self.pinned) && size(self.pinned) > 0)",
            message="mode Manual requires at least one pinned route",
            check=lambda s: s.mode != "Manual" or len(s.pinned) > 0,
            field_path=".pinned",
        ),
        CrossFieldRule(
            cel="!has(self.pinned) || self.pinned.all(p, size(p.destinations) <= self.budget.maxDestinationsPerKey)",
            message="a pinned route lists more destinations than budget.maxDestinationsPerKey",
            check=lambda s: all(len(p.destinations) <= s.budget.max_destinations_per_key for p in s.pinned),
            field_path=".pinned",
        ),
    )

    @model_validator(mode="after")
    def _cross_field(self) -> AffinityPlanSpec:
        enforce(self.rules, self)
        seen: set[str] = set()
        for pin in self.pinned:
            if pin.key in seen:
                raise ValueError(f"pinned lists the key {pin.key!r} twice")
            seen.add(pin.key)
        return self


class AffinityPlanStatus(ApiModel):
    """What the control loop last did. The figures describe the plan in effect (Auto, Manual) or
    the plan Shadow would apply; `candidateVersion` is the last plan computed, applied or not."""

    observed_generation: int | None = Field(default=None, ge=0)
    plan_version: str | None = Field(default=None, max_length=64, description="Version of the plan in effect.")
    applied_at: datetime | None = None
    candidate_version: str | None = Field(default=None, max_length=64, description="Version of the last candidate.")
    last_period_time: datetime | None = Field(
        default=None, description="When the last control period read its metrics window."
    )
    admitted_keys: int | None = Field(default=None, ge=0)
    covered_request_share: float | None = Field(default=None, ge=0, le=1)
    churn: float | None = Field(default=None, ge=0, le=1)
    forced_churn: float | None = Field(
        default=None, ge=0, le=1, description="Part of churn forced by destinations that left or lost room."
    )
    predicted_kv_hit: float | None = Field(default=None, ge=0, le=1)
    observed_kv_hit: float | None = Field(default=None, ge=0, le=1)
    predicted_p99_ttft_seconds: float | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list, max_length=16, json_schema_extra=CONDITIONS_FIELD)


class AffinityPlan(ApiModel):
    """The prefix-affinity routing policy of one InferencePool."""

    api_version: Literal["cacheroute.dev/v1alpha1"] = API_VERSION
    kind: Literal["AffinityPlan"] = "AffinityPlan"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: AffinityPlanSpec
    status: AffinityPlanStatus | None = None

    crd_plural: ClassVar[str] = "affinityplans"
    crd_short_names: ClassVar[tuple[str, ...]] = ("aplan", "aplans")
    crd_categories: ClassVar[tuple[str, ...]] = ("cacheroute",)
    crd_printer_columns: ClassVar[tuple[dict[str, Any], ...]] = (
        {"name": "Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
        {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
        # Ready stays True while a plan is in effect, whatever fails: what fails is Degraded's reason.
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Degraded", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Degraded")].reason',
         "description": "AsExpected, a wait (NoTraffic, PoolNotReady, IncompleteWindow) or what fails"},
        {"name": "Plan", "type": "string", "jsonPath": ".status.planVersion", "description": "Applied plan version"},
        {"name": "Keys", "type": "integer", "jsonPath": ".status.admittedKeys"},
        {"name": "KV hit", "type": "number", "jsonPath": ".status.observedKvHit", "format": "float"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    )
