"""plsh-client as a user installs it (ctest python_packaging): `pip install
./client/python` into a fresh venv made with --system-site-packages
(Debian's grpcio, protobuf, numpy and torch), offline (PIP_NO_INDEX: any
download would fail here at once instead of hanging), then imported with no
PYTHONPATH from another directory and used against a real plsh-server. The
same from an sdist built by the package's own backend, which must carry the
generated messages and the version (there is no repository around it).

The package is copied first (client/python, proto/ and the top-level
CMakeLists.txt, the files its build reads), so that pip's in-tree build
writes nothing into the checkout."""

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import Server

SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
USE = r"""
import os, sys
import numpy as np
import plsh_client, plsh_client.torch
from plsh_client._proto import pb
assert os.environ.get("PYTHONPATH") is None
assert plsh_client.__file__.startswith(sys.prefix), plsh_client.__file__
assert pb.__name__ == "plsh_client._proto.plsh_pb2", pb.__name__  # generated into the package
assert os.path.exists(os.path.join(os.path.dirname(plsh_client.__file__), "py.typed"))
print(plsh_client.__version__)
q = np.random.default_rng(0).standard_normal((1, 32, 2, 8)).astype(np.float32)
with plsh_client.Client(sys.argv[1]) as c:
    r = c.attend(q, q, q, mode="exact")
    assert r.out.shape == q.shape and r.mode == "exact"
    assert c.info().shard_row_align == 128
"""


def project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("project(plsh VERSION "):
                return line.split()[2]
    raise AssertionError("no project(plsh VERSION ...) line")


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(os.path.join(SOURCE, "client", "python"), root / "client" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".mypy_cache", "plsh_pb2.py",
                                                  "_build_info.py"))
    shutil.copytree(os.path.join(SOURCE, "proto"), root / "proto")
    shutil.copy(os.path.join(SOURCE, "CMakeLists.txt"), root / "CMakeLists.txt")
    return root


def venv(path):
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(path)], check=True)
    return path / "bin" / "python"


def env():
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLSH_PYTHON_STUBS")}
    e.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return e


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0, "".join(s.log)


def use(python, server, cwd):
    r = subprocess.run([str(python), "-c", USE, server.address], cwd=cwd, env=env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_pip_install_into_a_fresh_venv(copy, server, tmp_path):
    python = venv(tmp_path / "venv")
    r = subprocess.run([str(python), "-m", "pip", "install", str(copy / "client" / "python")], env=env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert use(python, server, tmp_path) == project_version()


def test_the_sdist_carries_the_messages_and_the_version(copy, server, tmp_path):
    package = copy / "client" / "python"
    dist = tmp_path / "dist"
    build = ("import sys; sys.path.insert(0, '_backend'); import plsh_build; "
             f"print(plsh_build.build_sdist({str(dist)!r}))")
    r = subprocess.run([sys.executable, "-c", build], cwd=package, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    sdist = dist / r.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as t:
        names = t.getnames()
    assert any(n.endswith("plsh_client/_proto/plsh_pb2.py") for n in names), names
    assert any(n.endswith("plsh_client/_build_info.py") for n in names), names
    python = venv(tmp_path / "venv")
    r = subprocess.run([str(python), "-m", "pip", "install", str(sdist)], env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert use(python, server, tmp_path) == project_version()
