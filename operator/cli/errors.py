"""How the `cacheroute` command line reports errors: one line, and an exit status that says whose.

- Bad input (an option out of range, a file that does not exist or does not parse) prints
  `error: <the input>: <the problem>` on standard error and exits with status 2.
- A failure of the world (a server that refuses, a disk that fills) exits with status 1.
- Never a Python traceback: `CommandLine`, the class of the root command, catches what escapes
  a command and reports it in one line (`CACHEROUTE_TRACEBACK=1` re-raises it, for debugging).

Every numeric option declares a range (typer's `min`/`max`): its coercion then refuses NaN and
infinities as well, since they compare outside any range.
"""

from __future__ import annotations

import errno
import math
import os
import re
import sys
from typing import Any

import typer
from typer.core import TyperGroup

TRACEBACK_ENV = "CACHEROUTE_TRACEBACK"
USAGE = 2
WORLD = 1

# typer (which vendors click since 0.2x) exports BadParameter only; its bases are the classes
# every usage error and every click exception derive from.
_USAGE_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_CLICK_EXCEPTION: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
# The head of click's "Invalid value for '--x' (env var: 'X'): problem", up to the problem.
_PARAM_HINT = re.compile(r"^(.*?'(?: \(env var: '[^']*'\))?): ")
# Errors that mean an input path is wrong rather than the machine.
_INPUT_ERRNOS = frozenset((errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EEXIST, errno.ENAMETOOLONG))


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def report(message: str) -> None:
    """Print `error: message` as one line on standard error."""
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()


def fail(message: str, code: int = USAGE) -> typer.Exit:
    """Report `message` and return the exit to raise (`raise fail(...) from None`)."""
    report(message)
    return typer.Exit(code)


def describe_os_error(exc: OSError) -> str:
    where = exc.filename if exc.filename is not None else ""
    reason = exc.strerror or str(exc)
    return f"{where}: {reason}" if where else reason


def non_finite_value(argv: list[str], param: Any) -> str | None:
    """The value given to `param` on the command line when it reads as NaN or an infinity: a
    range check then reports a bound the value does not even compare with."""
    names = set(getattr(param, "opts", ()) or ()) | set(getattr(param, "secondary_opts", ()) or ())
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name not in names:
            continue
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isfinite(number):
            return value
    return None


class CommandLine(TyperGroup):
    """The root command: whatever a sub-command raises ends as one line and an exit status."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        standalone = kwargs.pop("standalone_mode", True)
        kwargs["standalone_mode"] = False
        given = args[0] if args else kwargs.get("args")
        self._argv = [str(a) for a in (sys.argv[1:] if given is None else given)]
        try:
            result = super().main(*args, **kwargs)
        except Exception as exc:
            code = self._report(exc)
        else:
            if not standalone:
                return result
            # Without standalone mode an exit raised by the command comes back as its status.
            code = result if isinstance(result, int) else 0
        if not standalone:
            return code
        sys.exit(code)

    def _report(self, exc: Exception) -> int:
        if type(exc).__name__ == "NoArgsIsHelpError":
            # `cacheroute router` alone: the help of that command, as typer prints it.
            ctx = getattr(exc, "ctx", None)
            typer.echo(ctx.get_help() if ctx is not None else str(exc))
            return USAGE
        if isinstance(exc, _USAGE_ERROR):
            ctx = getattr(exc, "ctx", None)
            message = exc.format_message()  # type: ignore[attr-defined]
            bad = non_finite_value(self._argv, getattr(exc, "param", None))
            if bad is not None:
                hint = _PARAM_HINT.match(message)
                message = f"{hint.group(1) if hint else message.partition(': ')[0]}: {bad} is not a finite number"
            report(f"{ctx.command_path}: {message}" if ctx is not None else message)
            return USAGE
        if isinstance(exc, _CLICK_EXCEPTION):
            report(exc.format_message())  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", WORLD))
        if isinstance(exc, typer.Abort):
            report("aborted")
            return WORLD
        if os.environ.get(TRACEBACK_ENV):
            raise exc
        if isinstance(exc, OSError):
            if exc.errno == errno.EPIPE:
                return WORLD
            report(describe_os_error(exc))
            return USAGE if exc.errno in _INPUT_ERRNOS else WORLD
        if isinstance(exc, UnicodeDecodeError):
            report(f"input is not UTF-8 text ({exc.reason} at byte {exc.start})")
            return USAGE
        if isinstance(exc, MemoryError):
            report("out of memory (is an input or an option far larger than intended?)")
            return WORLD
        report(f"internal error: {type(exc).__name__}: {exc} (set {TRACEBACK_ENV}=1 to see where)")
        return WORLD
