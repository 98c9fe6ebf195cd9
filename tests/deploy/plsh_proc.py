"""Starting and stopping a real plsh-server: the one launcher of the deploy
tests, tests/python/conftest.py and bench/soak.py.

The server prints one "serving" event with the addresses it bound (port 0
picks a free one); with --log-format json it is one JSON object per line,
in the text format one line "... serving grpc=ADDR metrics=ADDR ..."."""
import collections
import json
import os
import re
import signal
import subprocess
import threading
import time


class ServerError(RuntimeError):
    pass


def serving_event(line):
    """The fields of a "serving" event, JSON or text format; None for any other line."""
    try:
        event = json.loads(line)
    except ValueError:
        if " serving " not in line:
            return None
        return dict(re.findall(r" (\w+)=(\S+)", line))
    return event if isinstance(event, dict) and event.get("event") == "serving" else None


class Server:
    """plsh-server as a child process, its stderr kept for error messages."""

    def __init__(self, binary, args=(), env=None, startup_timeout=30.0, inherit_env=True, tail=None):
        """inherit_env=False: exactly `env`, as in a container (image_test.py).
        tail=N: keep only the last N log lines (a long soak logs a line per
        request); line_count still counts them all."""
        self.command = [binary, *args]
        self.lines = collections.deque(maxlen=tail) if tail else []
        self.line_count = 0
        self.serving = None
        inherited = os.environ.items() if inherit_env else ()
        full_env = {k: v for k, v in inherited if not k.startswith("PLSH_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(self.command, env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                self.line_count += 1
                if self.serving is None:
                    self.serving = serving_event(line)
                    if self.serving is not None:
                        ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        deadline = time.monotonic() + startup_timeout
        while not ready.wait(0.1):
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"plsh-server did not report serving in {startup_timeout:.0f} s:\n{self._recent()}")
        if self.serving is None:
            code = self.proc.wait(5)
            raise ServerError(f"plsh-server exited with {code} before serving:\n{self._recent()}")

    @property
    def grpc(self):
        return self.serving["grpc"]

    @property
    def metrics(self):
        return self.serving["metrics"]

    def log(self, last=40):
        return self._recent(last)

    def _recent(self, last=40):
        # Not log() itself: conftest.Server's `log` is a list of lines.
        return "\n".join(list(self.lines)[-last:])

    def stop(self, timeout=30.0):
        """SIGTERM (the drain path), then SIGKILL if it hangs; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.pump.join(5)
        return self.proc.returncode
