"""PEP 517 build backend of plsh-client: setuptools' own hooks, run with the
setuptools of the interpreter that pip runs.

pyproject.toml declares no build requirements, so pip never asks an index
for setuptools (these machines have only Debian's packages, no PyPI). pip
still isolates the build: its sitecustomize takes the interpreter's site
directories off sys.path. This module puts back the ones that hold
setuptools (Debian's python3-setuptools in /usr/lib/python3/dist-packages,
or a venv's own), then hands every hook to setuptools.build_meta.
"""

import importlib.util
import re
import site
import sys


def _restore_site_directories():
    if importlib.util.find_spec("setuptools") is not None:
        return  # --no-build-isolation, or setuptools already in the build environment
    for path in site.getsitepackages():
        if path not in sys.path:
            sys.path.append(path)


_restore_site_directories()

from setuptools import build_meta as _setuptools  # noqa: E402  (after the path is restored)

build_sdist = _setuptools.build_sdist
build_wheel = _setuptools.build_wheel
prepare_metadata_for_build_wheel = _setuptools.prepare_metadata_for_build_wheel
build_editable = _setuptools.build_editable
prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist


def _requires(found):
    # setuptools asks for `wheel` to build wheels; pip would fetch it from an
    # index. Debian's python3-wheel is on the restored path: ask only when absent.
    return [name for name in found if importlib.util.find_spec(re.split(r"[<>=!~;\[ ]", name)[0]) is None]


def get_requires_for_build_wheel(config_settings=None):
    return _requires(_setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _requires(_setuptools.get_requires_for_build_editable(config_settings))
