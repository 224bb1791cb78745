"""The stand-in Hub, against the real huggingface_hub: scripts/download_model.py downloads a
gated repo from it with the right token only, as the image tests' Option 2 build does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from tests.test_docker import run_download

TOKEN = "hf_TheOneTokenWithAccess0042"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (repo / "tokenizer.json").write_text("{}")
    (repo / "model.safetensors").write_bytes(b"\1" * 4096)
    with FakeHub("acme/gated", repo, TOKEN) as server:
        yield server


def download(hub: FakeHub, tmp_path: Path, token: str | None) -> tuple[int, str]:
    secret = tmp_path / "no-secret"  # run_download's token file
    if token is None:
        secret.unlink(missing_ok=True)
    else:
        secret.write_text(token)
    done = run_download({"MODEL_NAME": "acme/gated", "HF_ENDPOINT": hub.url}, tmp_path)
    return done.returncode, done.stderr


def test_a_gated_repo_needs_the_token(hub: FakeHub, tmp_path: Path) -> None:
    status, stderr = download(hub, tmp_path, None)
    assert status == 1 and "GatedRepoError" in stderr and "--secret id=HF_TOKEN" in stderr
    status, stderr = download(hub, tmp_path, "hf_SomeoneElse")
    assert status == 1 and "the token's account has no access" in stderr
    refused = {r.status for r in hub.requests if "/resolve/" in r.path}
    assert refused == {401, 403}


def test_the_right_token_downloads_every_file(hub: FakeHub, tmp_path: Path) -> None:
    status, stderr = download(hub, tmp_path, TOKEN)
    assert status == 0, stderr
    args = json.loads((tmp_path / "local_model_args.json").read_text())
    snapshot = Path(args["MODEL_NAME"])
    assert snapshot.name == hub.commit
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == hub.files
    downloads = [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert len(downloads) == len(hub.files)
    assert all(r.token == TOKEN and r.status == 200 for r in downloads)


def test_unknown_repos_and_revisions_are_404s(hub: FakeHub) -> None:
    assert hub.answer("GET", "/api/models/acme/other/revision/main", TOKEN)[0] == 404
    assert hub.answer("GET", "/api/models/acme/other/revision/main", None)[0] == 401
    status, headers, _ = hub.answer("GET", "/api/models/acme/gated/revision/v9", TOKEN)
    assert status == 404 and headers["X-Error-Code"] == "RevisionNotFound"
    status, _, body = hub.answer("GET", "/api/agent-harnesses", None)
    assert status == 200 and json.loads(body) == {"standardEnvVars": [], "harnesses": {}}


def test_what_vllms_start_asks_is_answered(tmp_path: Path) -> None:
    """The tree (a folder's entries, or every file), paths-info, Range, new commits."""
    files = {"config.json": b"{}", "model.safetensors": b"w" * 100, "original/params.json": b"p"}
    with FakeHub() as hub:
        repo = hub.add("acme/public", files)
        status, _, body = hub.answer("GET", "/api/models/acme/public/tree/main", None)
        assert status == 200 and {(e["type"], e["path"]) for e in json.loads(body)} == {
            ("file", "config.json"), ("file", "model.safetensors"),
            ("directory", "original")}
        _, _, body = hub.answer("GET", "/api/models/acme/public/tree/main", None,
                                query="recursive=true")
        assert "original/params.json" in {e["path"] for e in json.loads(body)}
        _, _, body = hub.answer("POST", "/api/models/acme/public/paths-info/main", None,
                                form={"paths": ["original", "config.json", "nope"]})
        assert [e["type"] for e in json.loads(body)] == ["directory", "file"]
        _, _, body = hub.answer("GET", "/api/models/acme/public/revision/main", None,
                                query="blobs=true")
        [weights] = [s for s in json.loads(body)["siblings"] if "lfs" in s]
        assert weights["size"] == 100 and weights["rfilename"] == "model.safetensors"
        url = f"/acme/public/resolve/{repo.commit}/model.safetensors"
        status, headers, body = hub.answer("GET", url, None, range_header="bytes=90-")
        assert status == 206 and body == b"w" * 10
        assert headers["Content-Range"] == "bytes 90-99/100"
        first = repo.commit
        second = hub.push("acme/public", {**files, "README.md": b"new"})
        assert hub.answer("GET", f"/acme/public/resolve/{first}/config.json", None)[0] == 200
        assert hub.answer("GET", "/acme/public/resolve/main/README.md", None)[1][
            "X-Repo-Commit"] == second
        missing = hub.answer("GET", f"/acme/public/resolve/{first}/README.md", None)
        assert missing[0] == 404 and missing[1]["X-Repo-Commit"] == first  # → .no_exist


def test_latency_bandwidth_outages_and_the_count(tmp_path: Path) -> None:
    import time
    import urllib.error
    import urllib.request

    with FakeHub() as hub:
        repo = hub.add("acme/public", {"model.safetensors": b"w" * 40_000})
        url = f"{hub.url}/acme/public/resolve/{repo.commit}/model.safetensors"
        hub.bandwidth, hub.latency = 100_000, 0.2
        started = time.monotonic()
        with urllib.request.urlopen(url) as answer:
            assert len(answer.read()) == 40_000
        # The latency, then 40 kB at 100 kB/s: the last of ten 4 kB pieces goes out 0.36 s
        # after the first. A lower bound on the stand-in's own sleeps, taken from its settings
        # (time.sleep never ends early, and its token bucket never pays back time lost to a
        # slow machine), so a slow machine cannot break it; no upper bound, which one could.
        paced = hub.latency + (40_000 - 4_096) / hub.bandwidth
        assert time.monotonic() >= started + paced
        while hub.count() < 1:  # recorded once the body is sent
            time.sleep(0.01)
        assert hub.requests[-1].sent == 40_000 and hub.bytes_sent() == 40_000
        hub.latency, hub.outage = 0.0, "error"
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(url)
        assert error.value.code == 503
