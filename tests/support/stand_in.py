"""A stand-in for a vLLM API server process, for the process-handling tests
(``devstack.process`` and its users), and a wait for a pid to end. No vLLM.

``HTTP_STAND_IN`` (run as ``python -c HTTP_STAND_IN PORT PID_FILE BEHAVIOUR``) forks a
``sleep 60`` grandchild, as vLLM's API server forks its engine core, writes the grandchild's pid
to ``PID_FILE``, then: ``serve`` answers ``GET /health`` with 200 on ``127.0.0.1:PORT``; ``die``
prints a line and exits with 3; ``hang`` never becomes ready.
"""

from __future__ import annotations

import textwrap

from devstack.process import pid_alive
from tests.support.wait import WaitTimeout, wait_until

HTTP_STAND_IN = textwrap.dedent(
    """
    import http.server, subprocess, sys
    grandchild = subprocess.Popen(["sleep", "60"])
    open(sys.argv[2], "w").write(str(grandchild.pid))
    if sys.argv[3] == "die":
        print("fatal: stand-in failed on purpose", flush=True)
        sys.exit(3)
    if sys.argv[3] == "hang":
        grandchild.wait()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    """Wait until ``pid`` no longer runs; whether it stopped within ``timeout_s``."""
    try:
        wait_until(lambda: not pid_alive(pid), timeout=timeout_s, what=f"pid {pid} to end")
    except WaitTimeout:
        return False
    return True
