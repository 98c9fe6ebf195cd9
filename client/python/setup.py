"""setuptools' half of plsh-client's build (pyproject.toml has the metadata):
the version and the generated messages, both from the repository around
this directory, so that neither is a second copy kept by hand.

- version: project(plsh VERSION x.y.z) of ../../CMakeLists.txt, written into
  the package as plsh_client/_build_info.py;
- plsh_client/_proto/plsh_pb2.py: protoc --python_out of
  ../../proto/plsh/v1/plsh.proto (Debian's protobuf-compiler). protoc names
  the file by its path under -I, plsh/v1/plsh.proto, as CMake's
  plsh_proto_python target does: the two modules register one identical
  file descriptor, so a process may import both.

An sdist carries both results (there is no ../../ around it)."""

import os
import runpy
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, os.pardir, os.pardir))
PROTO_ROOT = os.path.join(REPO, "proto")
PROTO = "plsh/v1/plsh.proto"
GENERATED = os.path.join("plsh_client", "_proto", "plsh_pb2.py")
BUILD_INFO = os.path.join("plsh_client", "_build_info.py")


def project_version():
    cmake_lists = os.path.join(REPO, "CMakeLists.txt")
    if os.path.exists(cmake_lists):
        version_in = runpy.run_path(os.path.join(HERE, "plsh_client", "_version.py"))["version_in"]
        with open(cmake_lists, encoding="utf-8") as f:
            return version_in(f.read())
    return runpy.run_path(os.path.join(HERE, BUILD_INFO))["VERSION"]  # an sdist's


def generate_messages(into):
    """plsh_pb2.py at `into`/plsh_client/_proto/ (a source tree's proto), or
    False where there is none (an sdist, which carries the file)."""
    if not os.path.exists(os.path.join(PROTO_ROOT, PROTO)):
        return False
    protoc = shutil.which("protoc")
    if protoc is None:
        raise SystemExit("plsh-client: protoc not found, expected Debian's protobuf-compiler (apt-get install "
                         "protobuf-compiler) to generate the plsh.v1 messages")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([protoc, "-I", PROTO_ROOT, "--python_out", out, PROTO], check=True)
        target = os.path.join(into, GENERATED)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(out, "plsh", "v1", "plsh_pb2.py"), target)
    return True


def write_build_info(into):
    with open(os.path.join(into, BUILD_INFO), "w", encoding="utf-8") as f:
        f.write(f'"""Written by setup.py."""\n\nVERSION = "{project_version()}"\n')


class BuildPy(build_py):
    def run(self):
        super().run()
        if not self.dry_run:
            generate_messages(self.build_lib)
            write_build_info(self.build_lib)


class Sdist(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        generate_messages(base_dir)
        write_build_info(base_dir)


setup(version=project_version(), cmdclass={"build_py": BuildPy, "sdist": Sdist})
