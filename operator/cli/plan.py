"""`cacheroute plan`: compute a routing plan offline, from a trace or from per-key statistics."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from cacheroute.operator.api.manifests import check_name, field_errors
from cacheroute.operator.api.plan import MAX_DESTINATIONS_PER_KEY, MAX_PINNED, AffinityPlan
from cacheroute.operator.cli.errors import describe_os_error, fail
from cacheroute.operator.cli.statsfile import COLUMNS, StatsFileError, read_stats
from cacheroute.operator.control.plans import same_routing
from cacheroute.operator.files import OutputPathError, atomic_open, check_output_file, write_atomically
from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, key_stats_from_trace
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import MAX_DESTINATIONS, MAX_ROUTES, Destination, Plan, PlanError, validate_plan
from cacheroute.planner.plan_format import MAX_PAYLOAD_BYTES, PlanPayload, decode_plan, encode_plan
from cacheroute.planner.planning import PlanResult, compute_plan
from cacheroute.planner.settings import Budget, Stability

Output = Literal["json", "yaml", "table"]

PLAN_HELP = "\n\n".join(
    [
        "Compute a routing plan offline and print it as a ConfigMap payload, a Manual AffinityPlan, or a table.",
        "Input is a Mooncake trace (--trace; keys derived by --key) or a statistics file (--stats): CSV with a "
        f"header row, or JSON lines, with the columns {', '.join(COLUMNS)}. rate is requests per second; the token "
        "columns are means per request; prefix_tokens is the stable prefix a later request of the same key can "
        "reuse. A row with an empty key describes the traffic without a key.",
        "Destinations are --destinations N identical replicas <pool>-0 .. <pool>-(N-1), or --destinations-file: "
        "YAML or JSON, a list (or an object with a destinations list) of {id, address, weight, kvCapacityTokens, "
        "hostKvCapacityTokens}.",
        '-o json writes {"version", "pool", "binaryData": {file: base64 of gzip}, "configMaps": [{"name", '
        '"binaryData"}]}: each configMaps entry is the binaryData of one ConfigMap. -o yaml writes a Manual '
        "AffinityPlan whose pinned routes are the plan, keys in clear, for review in Git. -o table prints a summary.",
        f"Every plan passes validate_plan (at most {MAX_ROUTES:,} routes, {MAX_DESTINATIONS:,} destinations, "
        "addresses ip:port or host:port) before it is written. --out is replaced through a temporary file in the "
        "same folder; a plan without routes does not replace one with routes unless --allow-empty is given.",
    ]
)

err = Console(stderr=True)
# Limits of the numeric options: what a pool can be, and what keeps planning a matter of seconds.
MAX_KV_CAPACITY_TOKENS = 1 << 40
MAX_TRACE_SECONDS = 1e12


class CliInputError(ValueError):
    """Command-line input that cannot be used; printed without a traceback."""


def parse_budget_tokens(text: str) -> int | Literal["auto"]:
    if text.strip().lower() == "auto":
        return "auto"
    digits = text.strip()
    if not digits.isascii() or not digits.lstrip("-").isdigit() or len(digits) > 20:
        raise CliInputError(f"--budget-tokens must be 'auto' or a whole number of tokens, got {text!r}")
    value = int(digits)
    if not 0 <= value <= MAX_KV_CAPACITY_TOKENS:
        raise CliInputError(f"--budget-tokens must be between 0 and {MAX_KV_CAPACITY_TOKENS:,}, got {value}")
    return value


def _destination(obj: object, where: str) -> Destination:
    if not isinstance(obj, Mapping):
        raise CliInputError(f"{where}: expected an object with id, address, weight, kvCapacityTokens")
    unknown = set(obj) - {"id", "address", "weight", "kvCapacityTokens", "hostKvCapacityTokens"}
    if unknown:
        raise CliInputError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    if not isinstance(obj.get("id"), str) or not obj["id"]:
        raise CliInputError(f"{where}: id must be a non-empty string, got {obj.get('id')!r}")
    weight = obj.get("weight", 1.0)
    kv = obj.get("kvCapacityTokens", 0)
    address = obj.get("address", "")
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise CliInputError(f"{where}: weight must be a number, got {weight!r}")
    if isinstance(kv, bool) or not isinstance(kv, int):
        raise CliInputError(f"{where}: kvCapacityTokens must be an integer, got {kv!r}")
    host = obj.get("hostKvCapacityTokens", 0)
    if isinstance(host, bool) or not isinstance(host, int):
        raise CliInputError(f"{where}: hostKvCapacityTokens must be an integer, got {host!r}")
    if not isinstance(address, str):
        raise CliInputError(f"{where}: address must be a string (ip:port or host:port), got {address!r}")
    try:
        return Destination(obj["id"], address, float(weight), kv, host)
    except OverflowError:
        raise CliInputError(f"{where}: weight {weight!r} is not a finite number") from None


def _read_text(path: Path, what: str) -> str:
    """A UTF-8 input file's text; CliInputError naming the file otherwise."""
    try:
        return path.read_text("utf-8")
    except UnicodeDecodeError as exc:
        raise CliInputError(f"{what} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise CliInputError(f"{what} {path}: {exc.strerror or exc}") from None


def read_destinations(path: Path) -> list[Destination]:
    """A destinations file: YAML or JSON list of {id, address, weight, kvCapacityTokens}."""
    try:
        doc = yaml.safe_load(_read_text(path, "--destinations-file"))
    except yaml.YAMLError as exc:
        raise CliInputError(f"{path}: not YAML/JSON ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise CliInputError(f"{path}: nested too deeply") from None
    if isinstance(doc, Mapping) and "destinations" in doc:
        doc = doc["destinations"]
    if not isinstance(doc, list):
        raise CliInputError(f"{path}: expected a list of destinations (or an object with a destinations list)")
    if not doc:
        raise CliInputError(f"{path}: no destinations in it; a plan needs at least one")
    if len(doc) > MAX_DESTINATIONS:
        raise CliInputError(f"{path}: {len(doc):,} destinations, at most {MAX_DESTINATIONS:,}")
    return [_destination(d, f"{path} destinations[{i}]") for i, d in enumerate(doc)]


def parse_pins(pins: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pin in pins:
        key, sep, dests = pin.rpartition("=")
        if not sep or not key or not dests:
            raise CliInputError(f"--pin {pin!r} is not KEY=DEST[,DEST...]")
        if key in out:
            raise CliInputError(f"--pin names key {key!r} twice")
        named = [d.strip() for d in dests.split(",")]
        if not all(named):
            raise CliInputError(f"--pin {pin!r} has an empty destination (two commas in a row, or one at an end)")
        out[key] = named
    return out


def payload_json(payload: PlanPayload, pool: str) -> dict[str, Any]:
    """The plan as ConfigMap binaryData: all files, and the files of each ConfigMap."""

    def b64(name: str) -> str:
        return base64.b64encode(payload.files[name]).decode("ascii")

    return {
        "version": payload.version,
        "pool": pool,
        "binaryData": {name: b64(name) for name in payload.files},
        "configMaps": [
            {"name": cm, "binaryData": {name: b64(name) for name in files}} for cm, files in payload.configmaps.items()
        ],
    }


def read_payload_json(path: Path) -> Plan:
    """A previous plan, as written by `cacheroute plan -o json`."""
    if path.stat().st_size > 2 * MAX_PAYLOAD_BYTES:
        raise CliInputError(f"{path}: larger than any plan written by `cacheroute plan -o json`")
    text = _read_text(path, "plan")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise CliInputError(
            f"{path}: not JSON; --previous takes the payload `cacheroute plan -o json` writes (an AffinityPlan "
            "manifest from -o yaml holds pins, not the plan's placements)"
        ) from None
    try:
        files = {name: base64.b64decode(data, validate=True) for name, data in doc["binaryData"].items()}
    except (KeyError, TypeError, AttributeError, ValueError):
        raise CliInputError(f"{path}: not a plan written by `cacheroute plan -o json` (no valid binaryData)") from None
    try:
        return decode_plan(files)
    except PlanError as exc:
        raise CliInputError(f"{path}: {exc}") from None


def manual_manifest(
    result: PlanResult,
    stats: KeyStats,
    *,
    pool: str,
    name: str,
    budget: Budget,
    stability: Stability,
    pins_without_stats: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """A Manual AffinityPlan pinning every routed key (the heaviest MAX_PINNED when there are more).

    Pinned keys that had no statistics are routed too: pass them in `pins_without_stats`. The
    budget and stability it was planned with are written too, so that switching the plan to
    Auto later plans with the same settings.
    """
    rows = np.flatnonzero(result.routed)
    if len(rows) > MAX_PINNED:
        rows = rows[np.lexsort((rows, -result.key_load[rows]))[:MAX_PINNED]]
    rows = np.sort(rows)
    pinned = [{"key": stats.names[int(r)], "destinations": list(result.destinations_of_key(int(r)))} for r in rows]
    for key, ids in (pins_without_stats or {}).items():
        if len(pinned) < MAX_PINNED:
            pinned.append({"key": key, "destinations": list(ids)})
    spec: dict[str, Any] = {
        "poolRef": {"name": pool},
        "mode": "Manual",
        "budget": {
            "warmTokensPerDestination": budget.warm_tokens_per_destination,
            "autoFraction": budget.auto_fraction,
            "maxDestinationsPerKey": max(1, min(budget.max_destinations_per_key, MAX_DESTINATIONS_PER_KEY)),
            "maxKeyShareOfDestination": budget.max_key_share_of_destination,
        },
        "stability": {"maxChurn": stability.max_churn, "minGain": stability.min_gain},
        "pinned": pinned,
    }
    doc = {"apiVersion": "cacheroute.dev/v1alpha1", "kind": "AffinityPlan", "metadata": {"name": name}, "spec": spec}
    try:
        return AffinityPlan.model_validate(doc).wire()
    except ValidationError as exc:
        raise CliInputError("the plan does not fit a Manual AffinityPlan: " + "; ".join(field_errors(exc))) from None


def manual_credit_note(credit: float) -> str:
    """What a Manual AffinityPlan does not keep of a plan whose entries yield to load."""
    return (
        f"note: this plan credits its entries with {credit:.2f} of a prompt, so routers may send a planned "
        "request to a clearly less loaded replica (the prefixes it saves stay cached wherever they go); a "
        "Manual AffinityPlan holds every pinned key to its routes up to the spill threshold. An Auto "
        "AffinityPlan routes as this plan does."
    )


def summary_table(result: PlanResult, stats: KeyStats, payload: PlanPayload, console: Console) -> None:
    plan = result.plan
    s = plan.summary
    head = Table(title=f"plan {payload.version} for pool {plan.pool}", show_header=False)
    head.add_column("", style="bold")
    head.add_column("")
    head.add_row("routed keys", f"{s.admitted_keys:,} of {len(stats):,} ({len(plan.pinned_keys)} pinned)")
    head.add_row("share of requests", f"{100 * s.admitted_request_share:.1f}%")
    head.add_row("share of prompt tokens", f"{100 * s.admitted_token_share:.1f}%")
    head.add_row("predicted KV hit (planned keys)", f"{100 * (s.predicted_kv_hit or 0.0):.1f}%")
    head.add_row("max destination load", f"{result.objective:.3f} (lower bound {result.lower_bound:.3f})")
    head.add_row(
        "churn",
        f"{100 * result.churn:.1f}% (forced {100 * result.churn_forced:.1f}%, "
        f"voluntary {100 * result.churn_voluntary:.1f}%)",
    )
    head.add_row(
        "warm KV used", f"{float(result.warm_used.sum()):,.0f} of {float(result.warm_budget.sum()):,.0f} tokens"
    )
    head.add_row("payload", f"{payload.total_bytes:,} bytes gzip in {len(payload.configmaps)} ConfigMap(s)")
    head.add_row("reason", s.reason)
    console.print(head)
    counts = np.bincount(result.assignment_dests, minlength=len(plan.destinations))
    dt = Table(title="destinations")
    for col in ("id", "weight", "load", "planned", "keys", "warm KV used", "warm budget"):
        dt.add_column(col, justify="left" if col == "id" else "right")
    for i, d in enumerate(plan.destinations):
        dt.add_row(
            d.id,
            f"{d.weight:g}",
            f"{result.destination_load[i] / d.weight:.3f}",
            f"{result.planned_load[i] / d.weight:.3f}",
            f"{int(counts[i]):,}",
            f"{result.warm_used[i]:,.0f}",
            f"{result.warm_budget[i]:,.0f}",
        )
    console.print(dt)
    rows = np.flatnonzero(result.routed)
    top = rows[np.lexsort((rows, -result.key_load[rows]))[:10]]
    if len(top):
        kt = Table(title="heaviest routed keys")
        for col in ("key", "rate (req/s)", "stable prefix", "load", "destinations"):
            kt.add_column(col, justify="left" if col in ("key", "destinations") else "right")
        for r in top.tolist():
            kt.add_row(
                stats.names[r],
                f"{stats.rate[r]:.3f}",
                f"{stats.prefix_tokens[r]:,.0f}",
                f"{result.key_load[r]:.3f}",
                ", ".join(result.destinations_of_key(r)),
            )
        console.print(kt)


def _load_stats(
    trace: Path | None, stats_file: Path | None, key: str, start: float | None, end: float | None
) -> KeyStats:
    if (trace is None) == (stats_file is None):
        raise CliInputError("give exactly one of --trace or --stats")
    if stats_file is not None:
        if start is not None or end is not None:
            raise CliInputError("--window-start/--window-end apply to --trace only")
        return read_stats(stats_file)
    if start is not None and end is not None and not start < end:
        raise CliInputError(f"--window-start {start:g} must come before --window-end {end:g}")
    from cacheroute.planner.mooncake import TraceFormatError, parse_key_spec, read_mooncake

    assert trace is not None
    try:
        parse_key_spec(key)
    except ValueError as exc:
        raise CliInputError(f"--key: {exc}") from None
    try:
        parsed = read_mooncake(trace, key=key)
    except TraceFormatError as exc:
        raise CliInputError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise CliInputError(f"--trace {trace}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return key_stats_from_trace(parsed, start, end)


def _destinations(count: int | None, path: Path | None, pool: str, kv_capacity: int) -> list[Destination]:
    if (count is None) == (path is None):
        raise CliInputError("give exactly one of --destinations N or --destinations-file")
    if path is not None:
        return read_destinations(path)
    assert count is not None
    return [Destination(f"{pool}-{i}", "", 1.0, kv_capacity) for i in range(count)]


def refuse_emptying(out: Path, plan: Plan) -> None:
    """Refuse to replace a plan that has routes with one that has none (`--allow-empty` overrides)."""
    if len(plan) or not out.is_file():
        return
    try:
        existing = read_payload_json(out)
    except (CliInputError, OSError):
        return  # not a plan: nothing a router would lose
    if len(existing):
        raise CliInputError(
            f"--out {out} holds a plan with {len(existing):,} routes and the new plan has none "
            "(no key qualified); give --allow-empty to replace it anyway"
        )


def _write_table(out: Path | None, result: PlanResult, stats: KeyStats, payload: PlanPayload) -> None:
    if out is None:
        summary_table(result, stats, payload, Console())
        return
    with atomic_open(out) as handle:
        summary_table(result, stats, payload, Console(file=handle, width=160))
    err.print(f"wrote {out}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add `plan` to the `cacheroute` command line."""

    @app.command("plan", help=PLAN_HELP)
    def plan_command(
        *,
        trace: Annotated[
            Path | None, typer.Option("--trace", exists=True, dir_okay=False, help="Mooncake JSONL trace.")
        ] = None,
        stats_file: Annotated[
            Path | None,
            typer.Option(
                "--stats",
                exists=True,
                dir_okay=False,
                help=f"Per-key statistics, CSV or JSON lines ({', '.join(COLUMNS)}).",
            ),
        ] = None,
        destinations: Annotated[
            int | None,
            typer.Option(
                "--destinations", min=1, max=MAX_DESTINATIONS, help="Number of identical destinations <pool>-<i>."
            ),
        ] = None,
        destinations_file: Annotated[
            Path | None,
            typer.Option("--destinations-file", exists=True, dir_okay=False, help="YAML/JSON list of destinations."),
        ] = None,
        kv_capacity: Annotated[
            int,
            typer.Option(
                "--kv-capacity-tokens",
                min=0,
                max=MAX_KV_CAPACITY_TOKENS,
                help="KV capacity of each --destinations replica.",
            ),
        ] = 0,
        pool: Annotated[str, typer.Option("--pool", help="Pool name (ConfigMap <pool>-plan).")] = "pool",
        budget_tokens: Annotated[
            str, typer.Option("--budget-tokens", help="Warm KV tokens per destination, or auto.")
        ] = "auto",
        auto_fraction: Annotated[
            float,
            typer.Option(
                "--auto-fraction", min=0.001, max=1.0, help="With auto: share of each destination's KV capacity."
            ),
        ] = 0.6,
        max_per_key: Annotated[
            int,
            typer.Option(
                "--max-destinations-per-key", min=1, max=MAX_DESTINATIONS_PER_KEY, help="Replicas of a hot key."
            ),
        ] = 4,
        max_key_share: Annotated[
            float,
            typer.Option(
                "--max-key-share", min=0.001, max=1.0, help="Largest share of a destination one key may take."
            ),
        ] = 0.5,
        max_churn: Annotated[
            float, typer.Option("--max-churn", min=0.0, max=1.0, help="Largest share of load moved vs --previous.")
        ] = 0.1,
        min_gain: Annotated[
            float, typer.Option("--min-gain", min=0.0, max=1.0, help="Smallest relative gain worth a move.")
        ] = 0.02,
        previous: Annotated[
            Path | None,
            typer.Option(
                "--previous", exists=True, dir_okay=False, help="Previous plan (as written by -o json), for low churn."
            ),
        ] = None,
        pin: Annotated[
            list[str] | None, typer.Option("--pin", help="KEY=DEST[,DEST...]: always route KEY there (repeatable).")
        ] = None,
        window_start: Annotated[
            float | None,
            typer.Option("--window-start", min=0.0, max=MAX_TRACE_SECONDS, help="Trace seconds, inclusive."),
        ] = None,
        window_end: Annotated[
            float | None, typer.Option("--window-end", min=0.0, max=MAX_TRACE_SECONDS, help="Trace seconds, exclusive.")
        ] = None,
        key: Annotated[str, typer.Option("--key", help="Trace key: first-blocks:K or thread.")] = "first-blocks:4",
        prefill_s: Annotated[
            float,
            typer.Option(
                "--prefill-s-per-token", min=0.0, max=1.0,
                help="Cost model: prefill seconds per prompt token (default: Llama-3.3-70B FP8 on two H100s).",
            ),
        ] = CostModel.prefill_s_per_token,
        decode_s: Annotated[
            float,
            typer.Option(
                "--decode-s-per-token", min=0.0, max=1.0,
                help="Cost model: decode seconds per output token (default: Llama-3.3-70B FP8 on two H100s).",
            ),
        ] = CostModel.decode_s_per_token,
        host_copy_s: Annotated[
            float,
            typer.Option(
                "--host-copy-s-per-token", min=0.0, max=1.0,
                help="Cost model: seconds to copy one token of KV back from the host-memory tier (a prefix held "
                "there is valued net of it; 0 values it as on the GPU).",
            ),
        ] = CostModel.host_copy_s_per_token,
        name: Annotated[
            str | None, typer.Option("--name", help="AffinityPlan name for -o yaml (default: pool).")
        ] = None,
        generated_at: Annotated[
            str | None, typer.Option("--generated-at", help="Generation time to record (default: now, UTC).")
        ] = None,
        output: Annotated[str, typer.Option("--output", "-o", help="json, yaml or table.")] = "table",
        out: Annotated[
            Path | None, typer.Option("--out", dir_okay=False, help="Write to this file instead of stdout.")
        ] = None,
        allow_empty: Annotated[
            bool,
            typer.Option("--allow-empty", help="Let a plan without routes replace a plan with routes in --out."),
        ] = False,
    ) -> None:
        if output not in ("json", "yaml", "table"):
            raise fail(f"-o must be json, yaml or table, got {output!r}")
        try:
            check_name(pool, "InferencePool", "--pool")
            if name is not None:
                check_name(name, "AffinityPlan", "--name")
        except ValueError as exc:
            raise fail(str(exc)) from None
        try:
            if out is not None:
                check_output_file(out, "--out")
            with err.status("reading input…"):
                stats = _load_stats(trace, stats_file, key, window_start, window_end)
                dests = _destinations(destinations, destinations_file, pool, kv_capacity)
                prev = read_payload_json(previous) if previous is not None else None
            budget = Budget(
                warm_tokens_per_destination=parse_budget_tokens(budget_tokens),
                auto_fraction=auto_fraction,
                max_destinations_per_key=max_per_key,
                max_key_share_of_destination=max_key_share,
            )
            if budget.warm_tokens_per_destination == "auto" and not any(d.kv_capacity_tokens for d in dests):
                raise CliInputError(
                    "--budget-tokens auto needs the destinations' KV capacity: give --kv-capacity-tokens "
                    "(or kvCapacityTokens in --destinations-file), or a number of --budget-tokens"
                )
            stability = Stability(max_churn=max_churn, min_gain=min_gain)
            pins = parse_pins(pin or [])
            with err.status(f"planning {len(stats):,} keys onto {len(dests)} destinations…"):
                result = compute_plan(
                    stats,
                    dests,
                    pool=pool,
                    budget=budget,
                    stability=stability,
                    cost=CostModel(
                        prefill_s_per_token=prefill_s, decode_s_per_token=decode_s, host_copy_s_per_token=host_copy_s
                    ),
                    previous=prev,
                    pinned=pins,
                    generated_at=generated_at or datetime.now(UTC).isoformat(timespec="seconds"),
                )
                validate_plan(result.plan)
                payload = encode_plan(result.plan)
            if out is not None and output == "json" and not allow_empty:
                refuse_emptying(out, result.plan)
            known = set(stats.names) if pins else set()
            unknown_pins = {k: v for k, v in pins.items() if k not in known}
            text = ""
            if output == "json":
                text = json.dumps(payload_json(payload, pool), indent=2) + "\n"
            elif output == "yaml":
                routed = int(result.routed.sum()) + len(unknown_pins)
                if routed > MAX_PINNED:
                    err.print(
                        f"[yellow]warning:[/] {routed:,} routed keys; the AffinityPlan keeps the {MAX_PINNED:,} "
                        "heaviest (its pinned list is limited)"
                    )
                manifest = manual_manifest(
                    result,
                    stats,
                    pool=pool,
                    name=name or pool,
                    budget=budget,
                    stability=stability,
                    pins_without_stats=unknown_pins,
                )
                text = yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True)
        except (CliInputError, StatsFileError, PlanInputError, PlanError, OutputPathError) as exc:
            raise fail(str(exc)) from None
        except OSError as exc:
            raise fail(describe_os_error(exc)) from None
        try:
            if output == "table":
                _write_table(out, result, stats, payload)
            elif out is not None:
                write_atomically(out, text)
                # A Manual AffinityPlan is published under the operator's own version (the pool's
                # addresses are in it): naming this payload's would mislead a review.
                what = f"plan {payload.version}" if output == "json" else "a Manual AffinityPlan"
                err.print(f"wrote {out} ({what})", soft_wrap=True)
            else:
                typer.echo(text, nl=False)
            if output == "json" and prev is not None and same_routing(prev, result.plan):
                # The version hashes the summary too: say why a plan that routes alike has a new one.
                err.print(
                    "routes every request as --previous does; only its summary differs (and so its version): "
                    "the operator would not republish it",
                    soft_wrap=True,
                )
            if output == "yaml" and len(result.plan) and result.plan.entry_credit < 1.0:
                err.print(manual_credit_note(result.plan.entry_credit), soft_wrap=True)
        except OSError as exc:
            # The previous file, if any, is intact: the new one was written beside it.
            where = f"--out {out}" if out is not None else "to standard output"
            raise fail(f"cannot write {where}: {exc.strerror or exc}", 1) from None
