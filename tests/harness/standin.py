"""A stand-in for a trainer master's monitor endpoint (the real one is trainer/monitor.py), for
tests of what reads it: GET (or POST) of `path` answers `reply` after `delay` seconds;
`polls` counts the requests; `cut_short` claims more bytes than it sends, as a master that
dies mid-reply."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandInMaster:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, path: str = "/progress"):
        """Serve on host:port (0: any free port); OSError if it is taken."""
        self.reply: tuple[int, bytes] = (200, b"{}")
        self.delay = 0.0
        self.cut_short = False
        self.polls = 0
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                standin.polls += 1
                time.sleep(standin.delay)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body = standin.reply if self.path == path else (404, b"")
                claimed = len(body) + 100 * standin.cut_short
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(claimed))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the poller gave up waiting (its timeout): as a slow master sees it

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_port
        self.url = f"http://{host}:{self.port}{path}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def answer(self, report: dict[str, Any]) -> None:
        """Answer this report from now on."""
        self.reply = (200, json.dumps(report).encode())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
