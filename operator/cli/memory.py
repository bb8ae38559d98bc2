"""`cacheroute memory-plan`: the vLLM memory flags for a model, GPU and TP, with the breakdown behind them."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cacheroute.operator.cli.errors import fail
from cacheroute.planner.memory import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    MemoryPlan,
    MemoryPlanError,
    ModelArchitecture,
    PlanRequest,
    architecture_from_config,
    custom_gpu,
    gpu_by_name,
    plan_memory,
    preset,
)
from cacheroute.planner.memory.gpus import MAX_GPU_MEMORY_GIB
from cacheroute.planner.memory.presets import PRESET_CONFIGS, preset_key

GIB = 1 << 30
OUTPUTS = ("table", "json", "args")
# What vLLM's --mamba-ssm-cache-dtype accepts (operator/fleet/vllm-serve-options-*.txt).
MAMBA_SSM_DTYPES = ("auto", "float32", "float16")
# A Hugging Face config.json is a few kilobytes; anything past this is not one.
MAX_CONFIG_BYTES = 16 << 20
# Bounds of the token counts, as the InferencePool allows them (memory.maxModelLen, maxNumBatchedTokens).
MAX_MODEL_LEN = 10_485_760
MAX_MNBT = 1_048_576


def _load_model(spec: str) -> ModelArchitecture:
    """A preset name, or the path of a Hugging Face config.json."""
    if preset_key(spec) is not None:
        return preset(spec)
    path = Path(spec)
    if not path.exists():
        raise MemoryPlanError(f"model {spec!r} is neither a preset ({', '.join(PRESET_CONFIGS)}) nor a file")
    if not path.is_file():
        raise MemoryPlanError(f"model {spec!r}: {path} is not a file (give a config.json)")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise MemoryPlanError(f"model {spec!r}: {path} is over {MAX_CONFIG_BYTES >> 20} MiB, not a config.json")
        config = json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise MemoryPlanError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise MemoryPlanError(f"cannot read {path} as a config.json: not UTF-8 ({exc.reason})") from None
    except RecursionError:
        raise MemoryPlanError(f"cannot read {path} as a config.json: nested too deeply") from None
    except ValueError as exc:  # bad JSON, or an integer of thousands of digits
        raise MemoryPlanError(f"cannot read {path} as a config.json: {exc}") from None
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    return architecture_from_config(config, name=name or path.parent.name or path.stem, source=str(path))


def _count_or_auto(value: str, option: str, limit: int, lowest: int = 1) -> int | None:
    if value.strip().lower() == "auto":
        return None
    digits = value.replace(",", "").replace("_", "").strip()
    if not digits.isascii() or not digits.lstrip("-").isdigit() or len(digits) > 20:
        raise typer.BadParameter(f"{value!r} is neither auto nor a whole number", param_hint=option)
    number = int(digits)
    if not lowest <= number <= limit:
        raise typer.BadParameter(f"{value!r} must be between {lowest} and {limit:,}", param_hint=option)
    return number


def _host_kv(value: str | None) -> int | Literal["auto"] | None:
    """--host-kv-gib as the plan request takes it: bytes, auto, or None (no tier)."""
    text = "0" if value is None else value.strip().lower()
    if text == "auto":
        return "auto"
    if not text:
        return None
    gib = _count_or_auto(text, "--host-kv-gib", 65_536, lowest=0)
    assert gib is not None  # "auto" was answered above
    return gib * GIB or None


def _choice(value: str, choices: tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=option)
    return value


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def _render_table(console: Console, plan: MemoryPlan, quantization: str, gpu_name: str) -> None:
    b = plan.breakdown
    console.print(
        Text(
            f"Memory plan for {plan.model} ({quantization}) on {gpu_name}, TP={plan.tp} — {plan.source}",
            style="bold",
        )
    )
    table = Table(title="Per-GPU memory", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    details = b.peak.details() if b.peak else {}
    for name, value in b.rows():
        table.add_row(name, _gib(value), f"{100 * value / b.total:.1f}%")
        for part, amount in details.get(name, ()):
            if amount:
                table.add_row(f"  {part}", _gib(amount), "", style="dim")
    table.add_row("total", _gib(b.total), "100.0%", style="bold")
    console.print(table)

    cands = Table(title="max-num-batched-tokens candidates", title_justify="left")
    for column in ("mnbt", "KV GiB", "KV tokens", "max-num-seqs", "verdict"):
        cands.add_column(column, justify="right" if column != "verdict" else "left")
    for c in plan.candidates:
        chosen = c.mnbt == plan.max_num_batched_tokens
        verdict = ("chosen" if chosen else "fits") if c.fits else c.reason
        cands.add_row(
            str(c.mnbt),
            _gib(c.kv_cache_bytes),
            f"{c.kv_capacity_tokens:,}",
            str(c.max_num_seqs),
            verdict,
            style="bold green" if chosen else None,
        )
    console.print(cands)

    layout = plan.layout
    facts = [
        f"KV capacity: {plan.kv_capacity_tokens:,} tokens per replica, each of its {plan.tp} GPU(s) holding "
        f"a share of every token ({layout.attention_bytes_per_token:,} B per token per GPU, "
        f"block {layout.block_size} tokens, "
        f"{plan.num_blocks:,} blocks)",
        f"longest request: {plan.max_request_tokens:,} tokens; max-model-len {plan.max_model_len:,}",
    ]
    if plan.host.bytes:
        facts.append(
            f"host KV tier: {plan.host.gib:g} GiB per replica ({plan.host.source}), "
            f"{plan.host.capacity_tokens:,} tokens; the pod requests {plan.host.pod_memory_bytes / GIB:,.0f} GiB "
            "of host memory"
        )
    if layout.hybrid:
        facts.append(
            f"recurrent state: {layout.state_bytes_per_seq / (1 << 20):,.1f} MiB per running sequence "
            f"({layout.state_blocks_per_seq} blocks, {layout.mamba_cache_mode} mode), "
            f"mamba page padded {layout.mamba_padding_pct:.2f}%"
        )
    if b.kv_vs_vllm_default_bytes is not None and plan.max_num_batched_tokens != b.vllm_default_mnbt:
        facts.append(f"KV vs vLLM's default mnbt {b.vllm_default_mnbt}: {b.kv_vs_vllm_default_bytes / GIB:+.2f} GiB")
    for line in (*facts, *plan.notes):
        console.print(Text(line))
    console.print(Text("flags: " + shlex.join(plan.vllm_args()), style="cyan"))


def memory_plan(
    *,
    model: Annotated[
        str, typer.Option("--model", "-m", help=f"A preset ({', '.join(PRESET_CONFIGS)}) or a config.json path.")
    ],
    quantization: Annotated[str, typer.Option("--quantization", "-q", help="Weights: bf16 or fp8.")] = "bf16",
    gpu: Annotated[str, typer.Option("--gpu", help="GPU preset (h100-80gb, h200-141gb) or node product label.")] = (
        "h100-80gb"
    ),
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-gib",
            min=0.001,
            max=MAX_GPU_MEMORY_GIB,
            help="Memory CUDA reports, for a GPU that is not a preset.",
        ),
    ] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, max=64, help="Tensor parallel size.")] = 1,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto or fp8.")] = "auto",
    max_model_len: Annotated[
        str | None,
        typer.Option("--max-model-len", help="Tokens, or auto to fit memory. Default: the model's native length."),
    ] = None,
    mnbt: Annotated[
        str, typer.Option("--mnbt", "--max-num-batched-tokens", help="auto (choose) or a token count.")
    ] = "auto",
    max_num_seqs: Annotated[
        int | None, typer.Option("--max-num-seqs", min=1, max=65_536, help="Default: vLLM's.")
    ] = None,
    margin_gib: Annotated[float, typer.Option("--margin-gib", min=0, max=64, help="Safety margin kept free.")] = 1.0,
    weights_gib: Annotated[
        float | None,
        typer.Option(
            "--weights-gib",
            min=0.001,
            max=MAX_GPU_MEMORY_GIB,
            help="Weights per GPU, e.g. from vLLM's 'Model loading took'.",
        ),
    ] = None,
    mamba_ssm_dtype: Annotated[
        str,
        typer.Option(
            "--mamba-ssm-dtype",
            help="SSM state dtype of hybrids, as vLLM's --mamba-ssm-cache-dtype takes it: auto (the model's), "
            "float32 or float16.",
        ),
    ] = "auto",
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching")] = True,
    host_kv_gib: Annotated[
        str | None,
        typer.Option(
            "--host-kv-gib",
            help="Host-memory KV tier of one replica in GiB (0: none), or auto: its share of --node-memory-gib "
            "less --host-reserve-gib per GPU (InferencePool memory.hostKvCacheGib). Default: none.",
        ),
    ] = None,
    node_memory_gib: Annotated[
        float | None,
        typer.Option("--node-memory-gib", min=1, max=1 << 20, help="Allocatable memory of one node, for auto."),
    ] = None,
    host_reserve_gib: Annotated[
        float,
        typer.Option("--host-reserve-gib", min=0, max=4096, help="Host memory kept per GPU for the engine, for auto."),
    ] = 32.0,
    output: Annotated[str, typer.Option("--output", "-o", help="table, json or args.")] = "table",
) -> None:
    """Choose vLLM's memory flags from the model's worst-case execution path."""
    console = Console()
    output = _choice(output, OUTPUTS, "--output")
    quant = _choice(quantization.lower(), QUANTIZATIONS, "--quantization")
    kv_dtype = _choice(kv_cache_dtype.lower(), KV_CACHE_DTYPES, "--kv-cache-dtype")
    auto_len = max_model_len is not None and max_model_len.strip().lower() == "auto"
    length = None if max_model_len is None else _count_or_auto(max_model_len, "--max-model-len", MAX_MODEL_LEN)
    batched = _count_or_auto(mnbt, "--mnbt", MAX_MNBT)
    ssm_dtype = _choice(mamba_ssm_dtype.lower(), MAMBA_SSM_DTYPES, "--mamba-ssm-dtype")
    host_kv = _host_kv(host_kv_gib)
    try:
        gpu_model = custom_gpu(gpu_memory_gib, gpu) if gpu_memory_gib is not None else gpu_by_name(gpu)
        request = PlanRequest(
            model=_load_model(model),
            gpu=gpu_model,
            quantization=quant,  # type: ignore[arg-type]
            tp=tp,
            kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
            max_model_len=length,
            auto_max_model_len=auto_len,
            mnbt=batched,
            max_num_seqs=max_num_seqs,
            safety_margin_bytes=int(margin_gib * GIB),
            prefix_caching=prefix_caching,
            weights_bytes=int(weights_gib * GIB) if weights_gib is not None else None,
            mamba_ssm_dtype=None if ssm_dtype == "auto" else ssm_dtype,
            host_kv=host_kv,
            node_memory_bytes=int(node_memory_gib * GIB) if node_memory_gib is not None else None,
            host_reserve_bytes_per_gpu=int(host_reserve_gib * GIB),
        )
        plan = plan_memory(request)
    except MemoryPlanError as exc:
        # The model, the GPU and the flags given do not make a plan: bad input.
        raise fail(str(exc)) from None
    if output == "json":
        document: dict[str, Any] = plan.to_dict()
        typer.echo(json.dumps(document, indent=2))
    elif output == "args":
        typer.echo(shlex.join(plan.vllm_args()))
    else:
        # A GPU given by its memory is named with it: the product's own memory is not what was planned.
        where = gpu_model.name if gpu_memory_gib is None else f"{gpu_model.name} with {gpu_memory_gib:g} GiB per GPU"
        _render_table(console, plan, quant, where)


def register(app: typer.Typer) -> None:
    """Add `memory-plan` to the `cacheroute` command line."""
    app.command("memory-plan")(memory_plan)
