"""A loopback HTTP server of a test's own, standing in for a generation server or a router's worker."""

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONServer(ThreadingHTTPServer):
    """Answers every request on 127.0.0.1 with ``answer(path)`` (a dict, as JSON; the path without its query) and
    records each request as ``(method, path, headers)`` in ``seen`` (header names lower-cased). Serves from a daemon
    thread; ``shutdown()`` stops it."""

    daemon_threads = True

    def __init__(self, answer: Callable[[str], dict]) -> None:
        self.answer, self.seen = answer, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = json.dumps(server.answer(self.path.split("?")[0])).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:  # quiet: the test reads ``seen``
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"
