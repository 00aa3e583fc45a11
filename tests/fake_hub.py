"""A Hugging Face Hub of local folders, served over HTTP on 127.0.0.1: the endpoints
`huggingface_hub.snapshot_download` calls (the repo's commit, its file tree, each file), enough to
test what a fetch downloads without the real Hub. Point `HF_ENDPOINT` at :attr:`FakeHub.url`;
:attr:`FakeHub.served` records the files it sent."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class FakeHub:
    """Serves model repos `{repo_id: folder}` at commit `commit`."""

    def __init__(self, repos: dict[str, Path], commit: str) -> None:
        self.repos, self.commit = repos, commit
        self.served: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())

    def _answer(self, request: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(request.path).path)
        for repo in self.repos:
            api = f"/api/models/{repo}/"
            if path.startswith(api + "revision/"):
                files = [{"rfilename": f} for f in self._files(repo)]
                return _send(
                    request,
                    json.dumps({"id": repo, "sha": self.commit, "siblings": files}).encode(),
                    body,
                )
            if path.startswith(api + "tree/"):
                entries = [
                    {"type": "file", "path": f, "size": (self.repos[repo] / f).stat().st_size,
                     "oid": hashlib.sha1((self.repos[repo] / f).read_bytes()).hexdigest()}
                    for f in self._files(repo)
                ]  # fmt: skip
                return _send(request, json.dumps(entries).encode(), body)
            resolve = f"/{repo}/resolve/"
            if path.startswith(resolve):
                name = path[len(resolve) :].split("/", 1)[1]
                file = self.repos[repo] / name
                if file.is_file():
                    data = file.read_bytes()
                    if body:
                        self.served.append(name)
                    etag = hashlib.sha256(data).hexdigest()
                    return _send(
                        request, data, body, {"X-Repo-Commit": self.commit, "ETag": f'"{etag}"'}
                    )
        request.send_response(404)
        request.send_header("X-Error-Code", "EntryNotFound")
        request.send_header("Content-Length", "0")
        request.end_headers()


def _send(
    request: BaseHTTPRequestHandler, data: bytes, body: bool, headers: dict[str, str] | None = None
) -> None:
    request.send_response(200)
    for key, value in (headers or {}).items():
        request.send_header(key, value)
    request.send_header("Content-Length", str(len(data)))
    request.end_headers()
    if body:
        request.wfile.write(data)
