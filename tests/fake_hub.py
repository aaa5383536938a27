"""A local HTTP server that speaks the part of the Hugging Face hub's file API downloads use.

Endpoints: repo info (`/api/models/{repo}/revision/{rev}`), the file tree
(`/api/models/{repo}/tree/{rev}`) and files (`/{repo}/resolve/{rev}/{path}`, HEAD and GET with
Range). It records every request, and can cut a file's first transfer half-way to test resume.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_once: set[tuple[str, str]] = set()  # (repo, file) whose first GET is cut
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_gets(self) -> list[str]:
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]

    # -- request handling ------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        if m := re.fullmatch(r"/api/models/(.+?)/revision/([^/]+)", path):
            return self._json(h, self._info(m[1]), body)
        if m := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(/.*)?", path):
            return self._json(h, self._tree(m[1]), body)
        if m := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
            return self._file(h, m[1], m[3], body)
        return self._json(h, {"error": "not found"}, body, status=404)

    def _info(self, repo: str) -> dict | None:
        if repo not in self.repos:
            return None
        return {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in self.repos[repo]]}

    def _tree(self, repo: str) -> list | None:
        if repo not in self.repos:
            return None
        return [
            {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for f, data in self.repos[repo].items()
        ]

    def _json(self, h: BaseHTTPRequestHandler, payload, body: bool, status: int = 200) -> None:
        if payload is None:
            payload, status = {"error": "Repository not found"}, 404
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, name: str, body: bool) -> None:
        data = self.repos.get(repo, {}).get(name)
        if data is None:
            return self._json(h, {"error": "Entry not found"}, body, status=404)
        start = 0
        if (r := h.headers.get("Range")) and (m := re.fullmatch(r"bytes=(\d+)-", r)):
            start = int(m[1])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        if (repo, name) in self.cut_once:
            self.cut_once.discard((repo, name))
            h.wfile.write(data[start : start + (len(data) - start) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # cut mid-file
            return
        h.wfile.write(data[start:])
