"""plsh_client.__version__: plsh's one version, the project(plsh VERSION ...)
of the repository's top-level CMakeLists.txt. An installed package carries
it in _build_info.py, which setup.py writes from that same line; a source
checkout (PYTHONPATH=client/python) reads the line itself."""

import os
import re

_PROJECT_VERSION = re.compile(r"^project\(\s*plsh\s+VERSION\s+([0-9][0-9A-Za-z.+-]*)", re.MULTILINE)


def version_in(cmake_lists: str) -> str:
    """The version in a CMakeLists.txt's text; ValueError when it has none."""
    found = _PROJECT_VERSION.search(cmake_lists)
    if found is None:
        raise ValueError("no 'project(plsh VERSION x.y.z' line, expected one in the top-level CMakeLists.txt")
    return found.group(1)


def _version() -> str:
    try:
        from ._build_info import VERSION  # type: ignore[import]  # written by setup.py
        return str(VERSION)
    except ImportError:
        pass
    top = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, "CMakeLists.txt")
    try:
        with open(top, encoding="utf-8") as f:
            return version_in(f.read())
    except (OSError, ValueError):
        return "0+unknown"


__version__ = _version()
