"""Starting and stopping a real plsh-server for the deploy tests.

The server prints one "serving" event with the addresses it bound (port 0
picks a free one); with --log-format json it is one JSON object per line."""
import json
import os
import signal
import subprocess
import threading
import time


class ServerError(RuntimeError):
    pass


class Server:
    """plsh-server as a child process, its stderr kept for error messages."""

    def __init__(self, binary, args=(), env=None, startup_timeout=30.0, inherit_env=True):
        """inherit_env=False: exactly `env`, as in a container (image_test.py)."""
        self.lines = []
        self.serving = None
        inherited = os.environ.items() if inherit_env else ()
        full_env = {k: v for k, v in inherited if not k.startswith("PLSH_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen([binary, *args], env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if self.serving is None:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(event, dict) and event.get("event") == "serving":
                        self.serving = event
                        ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        deadline = time.monotonic() + startup_timeout
        while not ready.wait(0.1):
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"plsh-server did not report serving in {startup_timeout:.0f} s:\n{self.log()}")
        if self.serving is None:
            code = self.proc.wait(5)
            raise ServerError(f"plsh-server exited with {code} before serving:\n{self.log()}")

    @property
    def grpc(self):
        return self.serving["grpc"]

    @property
    def metrics(self):
        return self.serving["metrics"]

    def log(self):
        return "\n".join(self.lines[-40:])

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
