"""A remote reward endpoint on loopback for the tests of the reward clients: each response in the POSTed JSON gets
`score(response)`."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable, Iterator


@contextlib.contextmanager
def reward_server(score: Callable[[str], float]) -> Iterator[str]:
    """Serve in a thread while the block runs; yields the endpoint's URL."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = json.dumps({"rewards": [score(r) for r in body["responses"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    # A short poll: shutdown() waits for the next one (0.5 s by default).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score"
    finally:
        server.shutdown()
        server.server_close()
