"""What the deploy check scripts share: the problems a run finds (check()
records one unless its condition holds) and the end of a run (finish()), so
that every script reports alike: each problem on a FAIL: line of its own."""
import sys

problems = []  # of this process: scripts that import one another share it


def check(ok, message):
    """Records `message` as a problem unless `ok`; returns `ok`."""
    if not ok:
        problems.append(message)
    return ok


def finish(found, passed):
    """A run's exit code: 1 after printing every problem `found`, else 0
    after printing `passed`."""
    if found:
        print("\n".join("FAIL: " + p for p in found), file=sys.stderr)
        return 1
    print(passed)
    return 0
