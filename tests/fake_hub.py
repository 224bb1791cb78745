"""A loopback stand-in of the Hugging Face Hub: one gated model repo, every request counted.

``scripts/download_model.py`` runs the real ``huggingface_hub.snapshot_download`` against it
(``HF_ENDPOINT``). The routes are the ones huggingface_hub 2.4 calls for that (read in its
``_snapshot_download.py``, ``hf_api.py`` and ``file_download.py``):

* ``GET /api/models/<repo>/revision/<rev>`` (``repo_info``): ``{"id", "sha", "siblings", ...}``;
* ``GET /api/models/<repo>/tree/<rev>`` (``list_repo_tree``): the files, with git blob ids and
  LFS sha256s, in one page (no ``Link`` header);
* ``HEAD`` / ``GET /<repo>/resolve/<commit>/<file>`` (``hf_hub_download``): ``X-Repo-Commit``,
  ``ETag`` and ``Content-Length``, then the bytes;
* ``GET /api/agent-harnesses``: the empty registry huggingface_hub fetches before its first
  request when telemetry is on.

Like the real Hub for a gated repo, metadata is public and files need a token with access:
no token gives 401, another token 403, both with ``X-Error-Code: GatedRepo`` (the header
huggingface_hub turns into ``GatedRepoError``). Unknown repos and revisions answer 404 with
``RepoNotFound`` / ``RevisionNotFound``. Anything else is a 404 too, and counted.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

#: Files the Hub stores with LFS (their ETag is the sha256, as on huggingface.co).
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
EMPTY_AGENT_REGISTRY: dict[str, Any] = {"standardEnvVars": [], "harnesses": {}}


@dataclass(frozen=True)
class HubRequest:
    method: str
    path: str
    status: int
    token: str | None


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Serve ``folder`` as the gated model repo ``repo_id`` on 127.0.0.1."""

    def __init__(self, repo_id: str, folder: Path, token: str) -> None:
        self.repo_id = repo_id
        self.token = token
        self.files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        listing = "".join(f"{name} {git_blob_id(data)}\n" for name, data in self.files.items())
        self.commit = hashlib.sha1(listing.encode()).hexdigest()
        self.requests: list[HubRequest] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._make_handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def since(self, mark: int) -> list[HubRequest]:
        with self._lock:
            return self.requests[mark:]

    # -- what the Hub answers -------------------------------------------------------------
    def _entry(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                                 "oid": git_blob_id(data)}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    def _etag(self, name: str) -> str:
        entry = self._entry(name)
        return str(entry["lfs"]["oid"] if "lfs" in entry else entry["oid"])

    def answer(self, method: str, path: str, token: str | None,
               ) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for one request; pure, so it is testable without sockets."""
        def error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
            body = json.dumps({"error": message}).encode()
            return status, {"X-Error-Code": code, "Content-Type": "application/json"}, body

        def ok_json(payload: Any) -> tuple[int, dict[str, str], bytes]:
            return 200, {"Content-Type": "application/json"}, json.dumps(payload).encode()

        if path == "/api/agent-harnesses":
            return ok_json(EMPTY_AGENT_REGISTRY)
        repo_prefix = f"/api/models/{self.repo_id}"
        if path.startswith("/api/models/"):
            if not path.startswith(repo_prefix + "/") and path != repo_prefix:
                return error(401 if token is None else 404, "RepoNotFound", "Repository not found")
            rest = path[len(repo_prefix):].strip("/").split("/")
            if rest == [""] or rest[0] == "revision":
                revision = rest[1] if len(rest) > 1 else "main"
                if revision not in ("main", self.commit):
                    return error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return ok_json({"id": self.repo_id, "modelId": self.repo_id, "sha": self.commit,
                                "private": False, "gated": "manual", "disabled": False,
                                "siblings": [{"rfilename": name} for name in self.files]})
            if rest[0] == "tree":
                if len(rest) < 2 or rest[1] not in ("main", self.commit):
                    return error(404, "RevisionNotFound", "Invalid rev id")
                return ok_json([self._entry(name) for name in self.files])
            return error(404, "EntryNotFound", "Not found")
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(resolve):
            revision, _, name = path[len(resolve):].partition("/")
            if token is None:
                return error(401, "GatedRepo", f"Access to model {self.repo_id} is restricted. "
                             "You must have access to it and be authenticated to access it.")
            if token != self.token:
                return error(403, "GatedRepo", f"Access to model {self.repo_id} is restricted "
                             "and you are not in the authorized list.")
            if revision not in ("main", self.commit):
                return error(404, "RevisionNotFound", "Invalid rev id")
            if name not in self.files:
                return error(404, "EntryNotFound", f"{name} does not exist")
            data = self.files[name]
            headers = {"X-Repo-Commit": self.commit, "ETag": f'"{self._etag(name)}"',
                       "Content-Length": str(len(data)), "Accept-Ranges": "bytes"}
            return 200, headers, b"" if method == "HEAD" else data
        return error(404, "EntryNotFound", "Not found")

    # -- the HTTP side ----------------------------------------------------------------------
    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                path = unquote(urlsplit(self.path).path)
                auth = self.headers.get("Authorization", "")
                token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
                status, headers, body = hub.answer(self.command, path, token)
                with hub._lock:
                    hub.requests.append(HubRequest(self.command, path, status, token))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = _serve
            do_HEAD = _serve

        return Handler
