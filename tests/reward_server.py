"""Remote reward endpoints on loopback for the tests of the reward clients: one where each response in the POSTed
JSON gets `score(response)`, and one that answers fixed bytes (for replies a client must refuse)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
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

    with _serving(HTTPServer(("127.0.0.1", 0), Handler)) as url:
        yield url


@contextlib.contextmanager
def raw_reward_server(raw: bytes, delay_s: float = 0.0, busy_first: int = 0, bodies: list | None = None
                      ) -> Iterator[str]:
    """An endpoint that answers every POST with the bytes `raw` (200, their length declared), after `delay_s`; the
    first `busy_first` requests get 503 instead. The request bodies are appended to `bodies`, if given."""
    seen = [] if bodies is None else bodies

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            time.sleep(delay_s)
            try:
                self.send_response(503 if len(seen) <= busy_first else 200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up: what a slow test wants
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with _serving(server) as url:
        yield url


@contextlib.contextmanager
def _serving(server: HTTPServer) -> Iterator[str]:
    """`server` in a thread while the block runs; yields its endpoint's URL."""
    # A short poll: shutdown() waits for the next one (0.5 s by default).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score"
    finally:
        server.shutdown()
        server.server_close()
