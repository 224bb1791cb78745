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
