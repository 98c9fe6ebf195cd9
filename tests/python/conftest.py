"""Starts the real plsh-server on loopback (free ports) for the tests here.

Paths come from ctest's environment: PLSH_SERVER (the binary), PLSH_CLI (the
plsh tool), PLSH_PYTHON_STUBS (generated stubs); PYTHONPATH holds
client/python."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest


class Server:
    def __init__(self, *flags):
        self.proc = subprocess.Popen(
            [os.environ["PLSH_SERVER"], "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", *flags],
            stderr=subprocess.PIPE, text=True)
        self.log = []
        self.address = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r" serving .*grpc=(\S+)", line)
                if m:
                    self.address = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(20)
        if self.address is None:
            self.proc.kill()
            raise RuntimeError("plsh-server did not start:\n" + "".join(self.log))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


@pytest.fixture(scope="session")
def server():
    s = Server("--max-samples", "512")
    yield s
    assert s.stop() == 0, "".join(s.log)
