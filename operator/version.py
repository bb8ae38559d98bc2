"""The installed version of cacheroute (`cacheroute version`)."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("cacheroute")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0.0.0+unknown"
