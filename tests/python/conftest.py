"""Starts the real plsh-server on loopback (free ports) for the tests here.

Paths come from ctest's environment: PLSH_SERVER (the binary), PLSH_CLI (the
plsh tool), PLSH_PYTHON_STUBS (generated stubs); PYTHONPATH holds
client/python."""

import os
import sys

import pytest

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "deploy"))
import plsh_proc  # noqa: E402  (the launcher the deploy tests and bench/soak.py use too)


class Server(plsh_proc.Server):
    """plsh-server with these flags on free loopback ports: `address` is its
    grpc address, `log` its stderr lines so far (each ending in a newline)."""

    def __init__(self, *flags):
        super().__init__(os.environ["PLSH_SERVER"],
                         ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", *flags],
                         startup_timeout=20)

    @property
    def address(self):
        return self.grpc

    @property
    def log(self):
        return [line + "\n" for line in self.lines]


@pytest.fixture(scope="session")
def server():
    s = Server("--max-samples", "512")
    yield s
    assert s.stop() == 0, "".join(s.log)
