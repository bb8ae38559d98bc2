"""The router's settings: what the command line (or its environment variables) configures."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path

from cacheroute.planner.keyring import DEFAULT_UNPLANNED, UNPLANNED_MODES
from cacheroute.planner.plan import MAX_PROMPT_PREFIX_CHARS, SPILL_THRESHOLD_RANGE, KeyExtraction, is_header_name
from cacheroute.planner.prefixes import DEFAULT_PREFIX_MEMORY_BLOCKS
from cacheroute.planner.routing import DEFAULT_SPILL_SLACK
from cacheroute.planner.tokenload import DEFAULT_IN_FLIGHT_WEIGHT, DEFAULT_TOKENS_PER_LOAD_UNIT
from cacheroute.router.eventloop import EVENT_LOOPS

DEFAULT_GRPC_PORT = 9002
DEFAULT_METRICS_PORT = 9090
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_SKETCH_SIZE = 4096
# The body cap's own ceiling: bodies are kept in memory while a key is looked for.
MAX_BODY_BYTES_LIMIT = 64 * 1024 * 1024
MAX_SKETCH_SIZE = 1_000_000
MAX_PREFIX_MEMORY_BLOCKS = 16_777_216
# No endpoint holds a trillion tokens of KV: a larger figure is a unit mistake.
MAX_ENDPOINT_KV_TOKENS = 1 << 40


class SettingsError(ValueError):
    """A setting with a value the router cannot use; the message names the setting."""


def _check_range(name: str, value: float, lo: float, hi: float, *, open_low: bool = False, unit: str = "") -> None:
    """Refuse NaN, infinities and values outside [lo, hi] (or (lo, hi]), naming the option."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SettingsError(f"{name} {value!r} is not a number")
    if not math.isfinite(value) or value < lo or value > hi or (open_low and value == lo):
        low = f"> {lo:g}" if open_low else f">= {lo:g}"
        raise SettingsError(f"{name} {value!r} must be a finite number {low} and <= {hi:g}{unit}")


def parse_address(text: str, what: str = "endpoint") -> str:
    """Normalise `ip:port` (IPv6 as `[ip]:port`); raises SettingsError naming the bad value."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"{what} {text!r} is not ip:port")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError as exc:
        raise SettingsError(f"{what} {text!r}: {bare!r} is not an IP address") from exc
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


@dataclass(frozen=True)
class KeyOverrides:
    """Key-extraction settings given on the command line; None keeps the plan's value.

    An empty string (or 0 for the prefix length) switches that source off even when the plan
    enables it.
    """

    header: str | None = None
    body_field: str | None = None
    session_header: str | None = None
    prompt_prefix_chars: int | None = None

    def check(self) -> None:
        """Raise SettingsError for a header the plan format would refuse too."""
        headers = (("key-header", self.header, False), ("session-header", self.session_header, True))
        for flag, value, optional in headers:
            if value is None or (optional and value == ""):
                continue
            if not is_header_name(value):
                raise SettingsError(f"{flag} {value!r} is not an HTTP header name")

    def apply(self, base: KeyExtraction) -> KeyExtraction:
        return KeyExtraction(
            header=(self.header if self.header is not None else base.header).lower(),
            body_field=_override(self.body_field, base.body_field),
            session_header=_lower(_override(self.session_header, base.session_header)),
            prompt_prefix_chars=(
                self.prompt_prefix_chars if self.prompt_prefix_chars is not None else base.prompt_prefix_chars
            ),
        )


def _override(flag: str | None, base: str | None) -> str | None:
    value = base if flag is None else flag
    return value or None


def _lower(value: str | None) -> str | None:
    return value.lower() if value else None


@dataclass(frozen=True)
class RouterSettings:
    # 0.0.0.0: every interface, which inside a pod means the pod's own address (what a gateway
    # in another pod connects to). Outside a pod, bind a specific address.
    grpc_host: str = "0.0.0.0"
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_host: str = "0.0.0.0"
    metrics_port: int = DEFAULT_METRICS_PORT
    # The pod's Envoy's admin socket: its statistics are served with the router's (`envoystats.py`).
    envoy_admin_socket: Path | None = None
    # Plan sources: a mounted ConfigMap directory, or the ConfigMaps read through the API.
    plan_dir: Path | None = None
    namespace: str | None = None
    pool: str | None = None
    kubeconfig: Path | None = None
    plan_poll_interval: float = 0.2
    # Endpoints besides the plan's destinations.
    endpoints: tuple[str, ...] = ()
    service: str | None = None
    target_port: int | None = None
    keys: KeyOverrides = field(default_factory=KeyOverrides)
    spill_threshold: float | None = None
    spill_slack: float = DEFAULT_SPILL_SLACK
    fallbacks: int = 0
    unplanned: str = DEFAULT_UNPLANNED
    # Token-aware load: prompt tokens in flight that weigh one request (0: requests only).
    tokens_per_load_unit: float = DEFAULT_TOKENS_PER_LOAD_UNIT
    # What a request in flight weighs against a queued one (`planner/tokenload.py`).
    in_flight_weight: float = DEFAULT_IN_FLIGHT_WEIGHT
    # Computed routes also get their key's ring candidates (`routing.key_candidates`).
    widen_planned: bool = False
    # Requests follow the longest prefix of their prompt this router routed before (`following.py`).
    follow_prefixes: bool = True
    prefix_memory_blocks: int = DEFAULT_PREFIX_MEMORY_BLOCKS
    # KV tokens one endpoint holds, GPU and host tiers (0: not known): sizes the prefix memory
    # while no plan gives its destinations' capacities.
    endpoint_kv_tokens: int = 0
    scrape_interval: float = 0.5
    scrape_timeout: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sketch_size: int = DEFAULT_SKETCH_SIZE
    export_key_names: bool = False
    # How request/response bodies arrive when Envoy does not say (it does from 1.33 on).
    default_body_mode: str = "none"
    seed: int | None = None
    # auto: uvloop when installed, else the standard loop (see cacheroute.router.eventloop).
    event_loop: str = "auto"

    def __post_init__(self) -> None:
        for name in ("grpc_port", "metrics_port"):
            port = getattr(self, name)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
                raise SettingsError(f"{name.replace('_', '-')} {port} is not a TCP port (0-65535, 0 picks a free one)")
        for name in ("grpc_host", "metrics_host"):
            host = getattr(self, name).strip()
            if not host:
                raise SettingsError(f"{name.replace('_', '-')} must not be empty (0.0.0.0 listens everywhere)")
            # An IPv6 address binds bare: `[::1]` and `::1` are one address.
            object.__setattr__(self, name, host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        if self.target_port is not None and self.service is None:
            raise SettingsError("target-port is the port on a service's EndpointSlice addresses: it needs service")
        if self.namespace is not None and self.pool is None and self.service is None:
            raise SettingsError("namespace is where pool's ConfigMaps or service's EndpointSlices are read: it needs "
                                "pool or service")
        self.keys.check()
        if self.plan_dir is not None and self.pool is not None:
            raise SettingsError("give either plan-dir or pool (ConfigMaps through the API) as plan source, not both")
        if self.pool is not None and self.namespace is None:
            raise SettingsError(f"reading the ConfigMaps of pool {self.pool!r} needs namespace")
        if self.service is not None and self.namespace is None:
            raise SettingsError("watching EndpointSlices of a service needs namespace")
        if self.spill_threshold is not None:
            _check_range("spill-threshold", self.spill_threshold, *SPILL_THRESHOLD_RANGE)
        _check_range("spill-slack", self.spill_slack, 0, 1e6, unit=" requests")
        _check_range("fallbacks", self.fallbacks, 0, 16)
        if self.unplanned not in UNPLANNED_MODES:
            raise SettingsError(f"unplanned {self.unplanned!r} is not one of {', '.join(UNPLANNED_MODES)}")
        _check_range("tokens-per-load-unit", self.tokens_per_load_unit, 0, 1e9, unit=" tokens (0: requests only)")
        _check_range("in-flight-weight", self.in_flight_weight, 0, 1, unit=" (1: a queued request's weight)")
        _check_range("prefix-memory-blocks", self.prefix_memory_blocks, 1, MAX_PREFIX_MEMORY_BLOCKS)
        _check_range("endpoint-kv-tokens", self.endpoint_kv_tokens, 0, MAX_ENDPOINT_KV_TOKENS,
                     unit=" tokens (0: not known)")
        _check_range("scrape-interval", self.scrape_interval, 0, 3600, unit=" seconds (0 turns scraping off)")
        _check_range("scrape-timeout", self.scrape_timeout, 0, 600, open_low=True, unit=" seconds")
        _check_range("plan-poll-interval", self.plan_poll_interval, 0.01, 3600, unit=" seconds")
        _check_range("max-body-bytes", self.max_body_bytes, 0, MAX_BODY_BYTES_LIMIT)
        _check_range("sketch-size", self.sketch_size, 1, MAX_SKETCH_SIZE)
        if self.default_body_mode not in BODY_MODES:
            raise SettingsError(f"body-mode {self.default_body_mode!r} is not one of {', '.join(BODY_MODES)}")
        if self.event_loop not in EVENT_LOOPS:
            raise SettingsError(f"event-loop {self.event_loop!r} is not one of {', '.join(EVENT_LOOPS)}")
        if self.keys.prompt_prefix_chars is not None:
            _check_range("prompt-prefix-chars", self.keys.prompt_prefix_chars, 0, MAX_PROMPT_PREFIX_CHARS)
        if self.target_port is not None and not 0 < self.target_port < 65536:
            raise SettingsError(f"target-port {self.target_port} is not a TCP port (1-65535)")
        object.__setattr__(self, "endpoints", tuple(parse_address(e) for e in self.endpoints))

    @property
    def watches_configmaps(self) -> bool:
        return self.pool is not None


# Names accepted by --body-mode, matching Envoy's ProcessingMode.BodySendMode.
BODY_MODES = ("none", "streamed", "buffered", "buffered-partial", "full-duplex")
