"""A loopback stand-in of the Hugging Face Hub: model repos, gated or public, every request counted.

The real ``huggingface_hub`` (``scripts/download_model.py``, the worker's pre-flight and
prefetch) and vLLM talk to it through ``HF_ENDPOINT``. The routes are the ones huggingface_hub
2.4 calls for that (read in its ``_snapshot_download.py``, ``hf_api.py``, ``hf_file_system.py``
and ``file_download.py``):

* ``GET /api/models/<repo>[/revision/<rev>]`` (``model_info``, ``repo_info``): ``{"id", "sha",
  "siblings", ...}``; with ``?blobs=true`` each sibling carries its size, blob id and LFS info;
* ``GET /api/models/<repo>/tree/<rev>[/<path>]`` (``list_repo_tree``, ``HfFileSystem.ls``):
  the entries under a path, files and folders, or every file with ``?recursive=true``; one page
  (no ``Link`` header);
* ``POST /api/models/<repo>/paths-info/<rev>`` (``get_paths_info``, ``HfFileSystem.info``);
* ``HEAD`` / ``GET /<repo>/resolve/<rev>/<path>`` (``hf_hub_download``): ``X-Repo-Commit``,
  ``ETag`` and ``Content-Length``, then the bytes; a ``Range: bytes=N-`` request (a resumed
  download) gets ``206`` and the rest; a missing file ``404 EntryNotFound`` with the commit,
  from which huggingface_hub writes its ``.no_exist`` marker;
* ``GET /api/agent-harnesses``: the empty registry huggingface_hub fetches before its first
  request when telemetry is on.

A gated repo, like the real Hub's, has public metadata and serves files only to a token with
access: no token gives 401, another token 403, both with ``X-Error-Code: GatedRepo`` (the header
huggingface_hub turns into ``GatedRepoError``). Unknown repos and revisions answer 404 with
``RepoNotFound`` (401 without a token, as huggingface.co answers) / ``RevisionNotFound``.

What a test turns: ``latency`` (seconds before each answer), ``bandwidth`` (bytes per second of
file bodies, shared by every connection like one link), ``outage`` (``None``; ``"error"``: every
request answers 503; ``"hang"``: requests are read and never answered) and :meth:`FakeHub.push`
(a new commit on ``main``). Every request is recorded with its status and the body bytes sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.fake_job_api import SHUTDOWN_POLL

#: Files the Hub stores with LFS (their ETag is the sha256, as on huggingface.co).
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
EMPTY_AGENT_REGISTRY: dict[str, Any] = {"standardEnvVars": [], "harnesses": {}}
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")

Answer = tuple[int, dict[str, str], bytes]


@dataclass(frozen=True)
class HubRequest:
    method: str
    path: str
    status: int
    token: str | None
    sent: int = 0
    """Body bytes sent."""
    query: str = ""
    agent: str = ""
    """The User-Agent: huggingface_hub's names the library (``vllm/...``, ``worker-vllm/...``)."""

    @property
    def by_vllm(self) -> bool:
        return self.agent.startswith("vllm/")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_folder(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder``, by its path relative to it (``original/x.pth``)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def commit_of(files: dict[str, bytes], parent: str = "") -> str:
    listing = "".join(f"{name} {git_blob_id(data)}\n" for name, data in sorted(files.items()))
    return hashlib.sha1((parent + listing).encode()).hexdigest()


@dataclass
class HubRepo:
    """One model repo: its commits (the files of each) and its branch ``main``."""

    repo_id: str
    gated: bool = False
    token: str | None = None
    """The one token with access to a gated repo."""
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    main: str = ""

    @property
    def commit(self) -> str:
        return self.main

    @property
    def files(self) -> dict[str, bytes]:
        return self.commits[self.main]

    def push(self, files: dict[str, bytes]) -> str:
        commit = commit_of(files, self.main)
        self.commits[commit] = dict(files)
        self.main = commit
        return commit

    def resolve(self, revision: str) -> str | None:
        if revision == "main":
            return self.main
        return revision if revision in self.commits else None


def _entry(name: str, data: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                             "oid": git_blob_id(data)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
    return entry


def etag_of(name: str, data: bytes) -> str:
    """The ETag the Hub gives a file, and so the name of its blob in a cache."""
    entry = _entry(name, data)
    return str(entry["lfs"]["oid"] if "lfs" in entry else entry["oid"])


def _folder(path: str) -> dict[str, Any]:
    return {"type": "directory", "path": path, "oid": hashlib.sha1(path.encode()).hexdigest()}


def _error(status: int, code: str, message: str, **headers: str) -> Answer:
    body = json.dumps({"error": message}).encode()
    return status, {"X-Error-Code": code, "Content-Type": "application/json", **headers}, body


def _ok_json(payload: Any) -> Answer:
    return 200, {"Content-Type": "application/json"}, json.dumps(payload).encode()


class _Link:
    """A token bucket shared by every connection: ``rate`` bytes per second (None: no cap)."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._lock = threading.Lock()
        self._next = 0.0

    def send(self, write: Any, body: bytes, chunk: int = 4096) -> int:
        sent = 0
        for start in range(0, len(body), chunk):
            piece = body[start:start + chunk]
            rate = self.rate
            if rate:
                with self._lock:
                    now = time.monotonic()
                    self._next = max(self._next, now) + len(piece) / rate
                    wait = self._next - now - len(piece) / rate
                if wait > 0:
                    time.sleep(wait)
            write(piece)
            sent += len(piece)
        return sent


class FakeHub:
    """Model repos on 127.0.0.1. ``FakeHub(repo_id, folder, token)`` serves one gated repo."""

    def __init__(self, repo_id: str | None = None, folder: Path | None = None,
                 token: str | None = None) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[HubRequest] = []
        self.latency = 0.0
        self.outage: str | None = None
        self._link = _Link()
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._make_handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(SHUTDOWN_POLL,), daemon=True)
        self._first: HubRepo | None = None
        if repo_id is not None and folder is not None:
            self.add(repo_id, folder, gated=True, token=token)

    # -- repos -----------------------------------------------------------------------------
    def add(self, repo_id: str, folder: Path | dict[str, bytes], *, gated: bool = False,
            token: str | None = None) -> HubRepo:
        """Serve ``folder`` (or files by path) as model repo ``repo_id``; its first commit."""
        files = read_folder(folder) if isinstance(folder, Path) else dict(folder)
        repo = HubRepo(repo_id, gated=gated, token=token)
        repo.push(files)
        self.repos[repo_id] = repo
        self._first = self._first or repo
        return repo

    def push(self, repo_id: str, files: dict[str, bytes]) -> str:
        """A new commit of ``repo_id`` with ``files``; ``main`` moves to it."""
        return self.repos[repo_id].push(files)

    # The one-repo form of the first tests and the image tests.
    @property
    def repo_id(self) -> str:
        assert self._first is not None
        return self._first.repo_id

    @property
    def commit(self) -> str:
        assert self._first is not None
        return self._first.commit

    @property
    def files(self) -> dict[str, bytes]:
        assert self._first is not None
        return self._first.files

    # -- the server ------------------------------------------------------------------------
    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def bandwidth(self) -> float | None:
        return self._link.rate

    @bandwidth.setter
    def bandwidth(self, rate: float | None) -> None:
        self._link.rate = rate

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def since(self, mark: int) -> list[HubRequest]:
        with self._lock:
            return self.requests[mark:]

    def bytes_sent(self, since: int = 0) -> int:
        """File and metadata bytes sent since request number ``since``."""
        return sum(request.sent for request in self.since(since))

    # -- what the Hub answers -------------------------------------------------------------
    def answer(self, method: str, path: str, token: str | None, *, query: str = "",
               range_header: str | None = None, form: dict[str, list[str]] | None = None,
               ) -> Answer:
        """(status, headers, body) for one request; pure, so it is testable without sockets."""
        if path == "/api/agent-harnesses":
            return _ok_json(EMPTY_AGENT_REGISTRY)
        if path.startswith("/api/models/"):
            return self._api(method, path.removeprefix("/api/models/"), token,
                             parse_qs(query), form or {})
        repo, rest = self._split(path.lstrip("/"), "resolve")
        if repo is not None and rest is not None:
            return self._resolve(method, repo, rest, token, range_header)
        return _error(404, "EntryNotFound", "Not found")

    def _split(self, text: str, word: str) -> tuple[HubRepo | None, str | None]:
        """The repo a path names (``org/name/<word>/...``) and what follows ``<word>/``."""
        for repo_id, repo in self.repos.items():
            if text == repo_id or text.startswith(repo_id + "/"):
                rest = text[len(repo_id):].lstrip("/")
                if not word:
                    return repo, rest
                if rest.startswith(word + "/"):
                    return repo, rest[len(word) + 1:]
                return repo, None
        return None, None

    def _api(self, method: str, text: str, token: str | None, params: dict[str, list[str]],
             form: dict[str, list[str]]) -> Answer:
        repo, rest = self._split(text, "")
        if repo is None or rest is None:
            return _error(401 if token is None else 404, "RepoNotFound", "Repository not found")
        parts = rest.split("/") if rest else []
        action = parts[0] if parts else "revision"
        revision = unquote(parts[1]) if len(parts) > 1 else "main"
        commit = repo.resolve(revision)
        if action not in ("revision", "tree", "paths-info"):
            return _error(404, "EntryNotFound", "Not found")
        if commit is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[commit]
        if action == "revision":
            blobs = params.get("blobs", [""])[0].lower() == "true"
            siblings = [
                ({"rfilename": name, "size": len(data), "blobId": git_blob_id(data),
                  **({"lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                              "pointerSize": 134}} if name.endswith(LFS_SUFFIXES) else {})}
                 if blobs else {"rfilename": name})
                for name, data in files.items()
            ]
            return _ok_json({"id": repo.repo_id, "modelId": repo.repo_id, "sha": commit,
                             "private": False, "gated": "manual" if repo.gated else False,
                             "disabled": False, "siblings": siblings})
        if action == "tree":
            under = "/".join(parts[2:]).strip("/")
            recursive = params.get("recursive", [""])[0].lower() == "true"
            return _ok_json(self._tree(files, under, recursive))
        paths = form.get("paths", [])
        found: list[dict[str, Any]] = []
        for wanted in paths:
            wanted = wanted.strip("/")
            if wanted in files:
                found.append(_entry(wanted, files[wanted]))
            elif any(name.startswith(wanted + "/") for name in files):
                found.append(_folder(wanted))
        return _ok_json(found)

    @staticmethod
    def _tree(files: dict[str, bytes], under: str, recursive: bool) -> list[dict[str, Any]]:
        prefix = under + "/" if under else ""
        entries: dict[str, dict[str, Any]] = {}
        for name, data in files.items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if recursive or "/" not in rest:
                entries[name] = _entry(name, data)
                if recursive:  # the folders on the way, as the Hub lists them
                    for depth in range(1, rest.count("/") + 1):
                        folder = prefix + "/".join(rest.split("/")[:depth])
                        entries.setdefault(folder, _folder(folder))
            else:
                folder = prefix + rest.split("/", 1)[0]
                entries.setdefault(folder, _folder(folder))
        return list(entries.values())

    def _resolve(self, method: str, repo: HubRepo, rest: str, token: str | None,
                 range_header: str | None) -> Answer:
        revision, _, name = rest.partition("/")
        revision = unquote(revision)
        if repo.gated:
            if token is None:
                return _error(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted. "
                              "You must have access to it and be authenticated to access it.")
            if token != repo.token:
                return _error(403, "GatedRepo", f"Access to model {repo.repo_id} is restricted "
                              "and you are not in the authorized list.")
        commit = repo.resolve(revision)
        if commit is None:
            return _error(404, "RevisionNotFound", "Invalid rev id")
        files = repo.commits[commit]
        if name not in files:
            return _error(404, "EntryNotFound", f"{name} does not exist",
                          **{"X-Repo-Commit": commit})
        data = files[name]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag_of(name, data)}"',
                   "Accept-Ranges": "bytes"}
        status, body = 200, data
        match = _RANGE.match(range_header or "")
        if match and method == "GET":
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(data) - 1
            if start >= len(data):
                return 416, {"Content-Range": f"bytes */{len(data)}"}, b""
            status, body = 206, data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(body))
        return status, headers, b"" if method == "HEAD" else body

    # -- the HTTP side ----------------------------------------------------------------------
    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                parts = urlsplit(self.path)
                path = unquote(parts.path)
                auth = self.headers.get("Authorization", "")
                token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                form = parse_qs(raw.decode(errors="replace")) if raw else {}
                if hub.outage == "hang":
                    hub._release.wait()
                    return
                if hub.latency:
                    time.sleep(hub.latency)
                if hub.outage == "error":
                    status, headers, body = _error(503, "ServiceUnavailable",
                                                   "Service Unavailable")
                else:
                    status, headers, body = hub.answer(
                        self.command, path, token, query=parts.query,
                        range_header=self.headers.get("Range"), form=form)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                sent = 0
                try:
                    if self.command != "HEAD":
                        sent = hub._link.send(self.wfile.write, body)
                except OSError:
                    pass  # the client went away (a test stopped it)
                finally:
                    with hub._lock:
                        hub.requests.append(HubRequest(
                            self.command, path, status, token, sent, parts.query,
                            self.headers.get("User-Agent", "")))

            do_GET = _serve
            do_HEAD = _serve
            do_POST = _serve

        return Handler
