"""Adapters from a bucket (LORA_ADAPTERS_URI), in-process: the resolver's fetch against the
loopback S3 store (moto, tests/fake_s3.py), every failure, its disk, and its place in vLLM's
registry.

The resolver (plugin/lora_bucket) runs inside vLLM; here its fetch runs in the test, through
the same boto3 client it makes in vLLM, against the loopback store. Its decisions and the
worker's side: tests/test_bucket_adapters.py; the real vLLM serving an adapter from the
bucket: tests/test_e2e_adapters.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lora_bucket.answers import ANSWERS, KEPT, note, updated
from lora_bucket.checks import AdapterError, BucketUri
from lora_bucket.disk import MARKER, RESERVED, AdapterDisk
from lora_bucket.fetch import Fetcher
from lora_bucket.store import S3Store, Store

from tests.fake_s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, FakeS3

ROOT = Path(__file__).resolve().parents[1]
BASE = "acme/tiny"
BUCKET, PREFIX = "adapters", "loras"
SOURCE = BucketUri(BUCKET, PREFIX)
WEIGHTS = b"w" * 4000  # what the fetch copies; vLLM reads it (tests/test_e2e_adapters.py)


def adapter(base: str = BASE, rank: int = 8, peft: str = "LORA") -> dict[str, bytes]:
    config = {"peft_type": peft, "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"],
              "base_model_name_or_path": base}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": WEIGHTS}


@pytest.fixture(scope="module")
def store() -> Iterator[FakeS3]:
    s3 = FakeS3()
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    uploads = {name: adapter() for name in ("sql", "chat", "a", "b", "c", "d", "killed")}
    uploads |= {"other-base": adapter(base="org/another"), "big": adapter(rank=64),
                "prefix-tuning": adapter(peft="PREFIX_TUNING"),
                "no-weights": {"adapter_config.json": adapter()["adapter_config.json"]},
                # A file named as the fetch's reservation: never written over it.
                "reserved-key": {**adapter(), RESERVED: b"5"}}
    for name, files in uploads.items():
        for file, data in files.items():
            client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}/{file}", Body=data)
    try:
        yield s3
    finally:
        s3.stop()


def _nothing(key: str) -> None:
    pass


class Counting(Store):
    """The real store, counting the objects downloaded (and what ``on_download`` does first)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.downloads: list[str] = []
        self.on_download: Callable[[str], None] = _nothing

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def list(self, prefix: str) -> dict[str, int]:
        return self.inner.list(prefix)

    def download(self, key: str, path: str) -> None:
        self.on_download(key)
        self.downloads.append(key)
        self.inner.download(key, path)


def fetcher(s3: FakeS3, root: Path, *, bound: int = 1 << 30, source: BucketUri = SOURCE,
            env: dict[str, str] | None = None, clock: list[float] | None = None) -> Fetcher:
    ticks = clock if clock is not None else [0.0]

    def now() -> float:
        ticks[0] += 1
        return ticks[0]

    store = Counting(S3Store(source.bucket, env if env is not None else s3.env()))
    return Fetcher(source, store, AdapterDisk(root, bound, clock=now), BASE, 16,
                   log=lambda line: None)


def downloads(fetch: Fetcher) -> list[str]:
    assert isinstance(fetch.store, Counting)
    return fetch.store.downloads


def no_secret(message: str) -> str:
    assert ACCESS_KEY_ID not in message and SECRET_ACCESS_KEY not in message
    return message


def survives_vllm(message: str) -> str:
    """vLLM 0.32 answers a resolver's exception with its message through ``sanitize_message``
    (vllm/entrypoints/serve/exception_handling/utils.py), which turns a slash-path ending in a
    file name, or one under /tmp, /home, ..., into ``<path>``: the job must get the message
    whole."""
    sanitized = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>",
                       message)
    sanitized = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", sanitized)
    assert sanitized == message
    return message


# -- the fetch, against the loopback store ----------------------------------------------------
def test_an_adapter_is_fetched_whole_once_and_found_on_disk_after(
    store: FakeS3, tmp_path: Path
) -> None:
    first = fetcher(store, tmp_path)
    path = first.fetch("sql")
    assert path == tmp_path / "sql"
    assert (path / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == BASE
    assert json.loads((path / MARKER).read_text())["source"] == "s3://adapters/loras/sql/"
    assert first.fetch("sql") == path
    # Another worker on the same volume finds it whole: nothing is downloaded again.
    second = fetcher(store, tmp_path)
    assert second.fetch("sql") == path
    assert len(downloads(first)) == 2 and downloads(second) == []


def test_a_name_the_bucket_does_not_have_is_left_to_the_other_resolvers(
    store: FakeS3, tmp_path: Path
) -> None:
    fetch = fetcher(store, tmp_path)
    assert fetch.fetch("nope") is None
    assert fetch.fetch("acme/sql") is None  # a Hub name: never asked of the bucket
    assert not (tmp_path / "nope").exists()


def test_a_name_the_bucket_does_not_have_leaves_no_file(store: FakeS3, tmp_path: Path) -> None:
    """A job naming a model of another provider, or a typo: the bucket is asked, and nothing
    is written for the name (no lock of it stays in the folder); S3's answer is kept in the
    one file of answers, which holds the latest names only."""
    fetch = fetcher(store, tmp_path)
    for name in ("gpt-4o", "nope", "gpt-4o"):
        assert fetch.fetch(name) is None
    assert list(tmp_path.rglob("*")) == [tmp_path / ANSWERS]
    assert json.loads((tmp_path / ANSWERS).read_text()) == {
        "nope": {"answer": "missing", "code": "NoSuchKey"},
        "gpt-4o": {"answer": "missing", "code": "NoSuchKey"}}
    for index in range(KEPT + 10):
        assert fetch.fetch(f"typo-{index}") is None
    kept = json.loads((tmp_path / ANSWERS).read_text())
    assert list(kept) == [f"typo-{index}" for index in range(10, KEPT + 10)]
    assert list(tmp_path.rglob("*")) == [tmp_path / ANSWERS]
    assert fetch.fetch("sql") == tmp_path / "sql"  # one the bucket has: fetched as before


def test_keys_that_may_not_read_the_bucket_get_not_found_and_the_answer_is_kept(
    store: FakeS3, tmp_path: Path
) -> None:
    """S3 answers 403 for an object that is not there to keys that may not list the bucket,
    as for one they may not read: the resolver answers "not found" (vLLM's 404, not a 500)
    and keeps S3's answer for the worker's message."""
    lines: list[str] = []
    fetch = replace(fetcher(store, tmp_path, env=store.keys_allowed("s3:PutObject")),
                    log=lines.append)
    store.refuse_unknown_keys()
    try:
        assert fetch.fetch("sql") is None
        assert fetch.fetch("typo") is None
    finally:
        store.refuse_unknown_keys(False)
    kept = json.loads((tmp_path / ANSWERS).read_text())
    assert kept == {"sql": {"answer": "forbidden", "code": "AccessDenied"},
                    "typo": {"answer": "forbidden", "code": "AccessDenied"}}
    assert list(tmp_path.rglob("*")) == [tmp_path / ANSWERS]
    assert lines[0] == ("LoRA adapters: the store refused to read the adapter_config.json of "
                        "'sql' in s3://adapters/loras (AccessDenied); vLLM answers 404")
    # With keys that may read, the same name is fetched, and its answer is no longer asked.
    assert fetcher(store, tmp_path).fetch("sql") == tmp_path / "sql"


def test_the_answers_file_survives_what_is_written_over_it(tmp_path: Path) -> None:
    assert json.loads(updated("not json", "a", "missing", "NoSuchKey")) == {
        "a": {"answer": "missing", "code": "NoSuchKey"}}
    assert json.loads(updated("[1]", "a", "forbidden", "AccessDenied")) == {
        "a": {"answer": "forbidden", "code": "AccessDenied"}}
    # The newest last: a name asked again moves to the end.
    text = updated(updated(updated("", "a", "missing", "x"), "b", "missing", "x"),
                   "a", "forbidden", "y")
    assert list(json.loads(text)) == ["b", "a"]
    # A root that cannot be written keeps nothing and fails nothing.
    (tmp_path / "file").write_text("")
    note(tmp_path / "file", "a", "missing", "NoSuchKey")


def test_a_fetch_counts_toward_the_bound_until_it_is_in_place(
    store: FakeS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another fetch's room counts this one's bytes at every moment: under way up to the
    rename that puts it in place, a whole adapter from the rename on."""
    real_rename = os.rename
    counted: list[int] = []

    def total() -> int:
        disk = AdapterDisk(tmp_path, 1 << 30)
        return disk.in_flight() + sum(entry.size for entry in disk.entries())

    def rename(source: Any, target: Any) -> None:
        into_place = Path(target).parent == tmp_path  # not an eviction's
        if into_place:
            counted.append(total())
        real_rename(source, target)
        if into_place:
            counted.append(total())

    monkeypatch.setattr(os, "rename", rename)
    assert fetcher(store, tmp_path).fetch("chat") == tmp_path / "chat"
    size = len(adapter()["adapter_config.json"]) + len(WEIGHTS)
    assert len(counted) == 2 and min(counted) >= size, counted
    assert not (tmp_path / "chat" / RESERVED).exists()  # the reservation ends with the fetch


def test_a_file_of_the_bucket_named_as_the_reservation_is_not_fetched(
    store: FakeS3, tmp_path: Path
) -> None:
    fetch = fetcher(store, tmp_path)
    reserved: list[int] = []
    assert isinstance(fetch.store, Counting)
    fetch.store.on_download = lambda key: reserved.append(fetch.disk.in_flight())
    assert fetch.fetch("reserved-key") == tmp_path / "reserved-key"
    size = len(adapter()["adapter_config.json"]) + len(WEIGHTS)
    assert reserved == [size, size]  # the fetch's own reservation, at each file
    assert sorted(p.name for p in (tmp_path / "reserved-key").iterdir()) == [
        MARKER, "adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize(
    ("name", "needles"),
    [("other-base", ("The adapter 'other-base' in s3://adapters/loras cannot be served: its "
                     "adapter_config.json names the base model 'org/another'",
                     f"set its base_model_name_or_path to {BASE!r}")),
     ("big", ("r=64", "MAX_LORA_RANK=64")),
     ("prefix-tuning", ("peft_type 'PREFIX_TUNING'", "LORA adapters only")),
     ("no-weights", ("The adapter 'no-weights' in s3://adapters/loras", "no weights"))],
)
def test_an_adapter_vllm_would_not_take_is_told_why(
    store: FakeS3, tmp_path: Path, name: str, needles: tuple[str, ...]
) -> None:
    fetch = fetcher(store, tmp_path)
    with pytest.raises(AdapterError) as raised:
        fetch.fetch(name)
    message = survives_vllm(no_secret(str(raised.value)))
    assert all(needle in message for needle in needles), message
    assert not (tmp_path / name).exists() and downloads(fetch) == []


def test_keys_the_store_refuses(store: FakeS3, tmp_path: Path) -> None:
    """Keys that may read an adapter's config but not list its folder: the fetch fails with
    what the store refused (the config read refused: not found, the test above)."""
    fetch = fetcher(store, tmp_path, env=store.keys_allowed("s3:GetObject"))
    store.refuse_unknown_keys()
    try:
        with pytest.raises(AdapterError) as raised:
            fetch.fetch("sql")
    finally:
        store.refuse_unknown_keys(False)
    message = survives_vllm(no_secret(str(raised.value)))
    assert message.startswith("The store refused to list the files of the adapter 'sql' in "
                              "s3://adapters/loras (AccessDenied)"), message
    assert "s3:GetObject and s3:ListBucket" in message


def test_a_bucket_that_does_not_exist(store: FakeS3, tmp_path: Path) -> None:
    fetch = fetcher(store, tmp_path, source=BucketUri("no-such-bucket", "loras"))
    with pytest.raises(AdapterError) as raised:
        fetch.fetch("sql")
    assert survives_vllm(no_secret(str(raised.value))).startswith(
        "The bucket of s3://no-such-bucket/loras does not exist at this store (NoSuchBucket)")


def test_a_store_that_does_not_answer(store: FakeS3, tmp_path: Path) -> None:
    from tests.conftest import free_port

    env = store.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")  # nothing listens
    fetch = fetcher(store, tmp_path, env=env)
    with pytest.raises(AdapterError) as raised:
        fetch.fetch("sql")
    assert survives_vllm(no_secret(str(raised.value))).startswith(
        "The store did not answer a request to read the adapter_config.json of the adapter "
        "'sql' in s3://adapters/loras (EndpointConnectionError)")


def test_two_first_uses_at_once_fetch_once(store: FakeS3, tmp_path: Path) -> None:
    """Two workers on one volume (two fetchers, each its own locks) name a new adapter at
    once: the second waits on the first's fetch lock, then finds the adapter whole."""
    first, second = fetcher(store, tmp_path), fetcher(store, tmp_path)
    downloading, go = threading.Event(), threading.Event()

    def hold_the_download(key: str) -> None:
        downloading.set()
        assert go.wait(60), "the test never let the first download go on"

    assert isinstance(first.store, Counting)
    first.store.on_download = hold_the_download
    waiting = threading.Event()
    fetching = second.disk.fetching

    def announce(name: str) -> contextlib.AbstractContextManager[None]:
        waiting.set()
        return fetching(name)

    second.disk.fetching = announce  # type: ignore[method-assign,assignment]
    results: dict[str, Path | None] = {}
    threads = [threading.Thread(target=lambda f=f, k=k: results.__setitem__(k, f.fetch("chat")))
               for f, k in ((first, "first"), (second, "second"))]
    threads[0].start()
    assert downloading.wait(60), "the first fetch never downloaded"
    threads[1].start()
    assert waiting.wait(60), "the second fetch never reached the lock"
    go.set()
    for thread in threads:
        thread.join(60)
    assert results == {"first": tmp_path / "chat", "second": tmp_path / "chat"}
    assert len(downloads(first)) == 2 and downloads(second) == []


KILLED = """
import os, signal, sys
from pathlib import Path
from lora_bucket.checks import BucketUri
from lora_bucket.disk import AdapterDisk
from lora_bucket.fetch import Fetcher
from lora_bucket.store import S3Store

class DiesMidway(S3Store):
    def download(self, key, path):
        if Path(path).name == "adapter_model.safetensors":  # the config is written: die
            os.kill(os.getpid(), signal.SIGKILL)
        super().download(key, path)

Fetcher(BucketUri("adapters", "loras"), DiesMidway("adapters", os.environ),
        AdapterDisk(Path(sys.argv[1]), 1 << 30), "acme/tiny", 16).fetch("killed")
"""


def test_a_fetch_killed_halfway_leaves_no_adapter(store: FakeS3, tmp_path: Path) -> None:
    env = {**os.environ, **store.env(), "PYTHONPATH": f"{ROOT / 'plugin'}"}
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], env=env, timeout=120,
                          check=False, capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    assert not (tmp_path / "killed").exists()  # what vLLM would load is not there
    halves = list((tmp_path / ".partial").iterdir())
    assert [p.name.split("+")[0] for p in halves] == ["killed"]
    assert {p.name for p in halves[0].iterdir()} == {"adapter_config.json", RESERVED}
    # The next fetch (its lock went with the killed process) fetches it whole.
    fetch = fetcher(store, tmp_path)
    assert fetch.fetch("killed") == tmp_path / "killed"
    assert (tmp_path / "killed" / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert list((tmp_path / ".partial").iterdir()) == []


def test_the_least_recently_used_are_evicted_under_the_bound(
    store: FakeS3, tmp_path: Path
) -> None:
    size = len(adapter()["adapter_config.json"]) + len(WEIGHTS) + 200  # with the marker
    bound = 2 * size + size // 2  # two adapters fit, not three
    clock = [0.0]
    (tmp_path / "mine").mkdir(parents=True)  # a folder of the user's: never evicted
    (tmp_path / "mine" / "adapter_model.safetensors").write_bytes(WEIGHTS * 4)
    gone = fetcher(store, tmp_path, bound=bound, clock=clock)  # a worker that stopped
    gone.fetch("a")
    gone.fetch("b")
    for name in ("a", "b"):
        gone.disk.release(name)
    used = fetcher(store, tmp_path, bound=bound, clock=clock)  # a running worker uses "b"...
    assert used.fetch("b") == tmp_path / "b"  # ... now the most recently used
    now = fetcher(store, tmp_path, bound=bound, clock=clock)
    now.fetch("c")
    assert not (tmp_path / "a").exists()  # the least recently used went
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {
        "b", "c", "mine"}
    # "b" is held by a running vLLM, "c" by this one: "d" goes over the bound, evicting none.
    lines: list[str] = []
    now.log = lines.append
    now.fetch("d")
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {
        "b", "c", "d", "mine"}
    assert any("over LORA_ADAPTERS_DISK_GIB with 'd'" in line for line in lines), lines
    # Once the worker using "b" stops, the next fetch evicts it.
    used.disk.release("b")
    fetcher(store, tmp_path, bound=bound, clock=clock).fetch("sql")
    assert not (tmp_path / "b").exists() and (tmp_path / "mine").exists()


class HeldFetch:
    """A fetch of ``name`` in a thread of its own, held at its weights until :meth:`finish`:
    a fetch under way, as vLLM runs several at once."""

    def __init__(self, store: FakeS3, root: Path, bound: int, name: str) -> None:
        self.name = name
        self.started, self.released = threading.Event(), threading.Event()
        self.fetch = fetcher(store, root, bound=bound)
        assert isinstance(self.fetch.store, Counting)
        self.fetch.store.on_download = self._hold
        self.thread = threading.Thread(target=self.fetch.fetch, args=(name,))
        self.thread.start()
        assert self.started.wait(60), f"the fetch of {name} never reached its weights"

    def _hold(self, key: str) -> None:
        if key.endswith(f"{self.name}/adapter_model.safetensors"):
            self.started.set()
            assert self.released.wait(60), "the test never let the fetch go on"

    def finish(self) -> None:
        self.released.set()
        self.thread.join(60)


def one_left_to_go(store: FakeS3, root: Path) -> int:
    """A bound that holds two adapters, not three, and ``a`` on disk, fetched by a worker
    that stopped (so that it may go)."""
    size = len(adapter()["adapter_config.json"]) + len(WEIGHTS) + 200
    gone = fetcher(store, root, bound=2 * size + size // 2)
    gone.fetch("a")
    gone.disk.release("a")
    return gone.disk.bound


def test_fetches_under_way_make_room_for_each_other(store: FakeS3, tmp_path: Path) -> None:
    """vLLM resolves names in threads: a fetch under way counts toward the bound with what it
    reserved, so a second one evicts for both; a half folder left by a killed fetch counts
    for nothing."""
    (tmp_path / ".partial" / "killed+1+1").mkdir(parents=True)  # no fetch holds its lock
    (tmp_path / ".partial" / "killed+1+1" / RESERVED).write_text(str(1 << 30))
    bound = one_left_to_go(store, tmp_path)
    assert AdapterDisk(tmp_path, bound).in_flight() == 0
    first = HeldFetch(store, tmp_path, bound, "b")
    try:
        reserved = first.fetch.disk.in_flight()
        assert len(WEIGHTS) < reserved < bound // 2  # "b", under way
        fetcher(store, tmp_path, bound=bound).fetch("c")  # "a" and "b" and "c" do not fit
        assert not (tmp_path / "a").exists()
    finally:
        first.finish()
    whole = {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")}
    assert whole == {"b", "c"}
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()
               and ".partial" not in p.parts) <= bound
    assert not list((tmp_path / "b").glob(RESERVED))  # the reservation ends with the fetch


def test_a_fetch_that_ends_while_room_is_made_is_counted(
    store: FakeS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch renames its folder into place outside the eviction's lock: one that ends while
    another makes room is counted (twice at worst), never missed."""
    bound = one_left_to_go(store, tmp_path)
    first = HeldFetch(store, tmp_path, bound, "b")
    counted = AdapterDisk.in_flight

    def ends_first(disk: AdapterDisk) -> int:  # "b" is renamed into place right now
        first.finish()
        assert (tmp_path / "b").is_dir(), "the first fetch never ended"
        return counted(disk)

    monkeypatch.setattr(AdapterDisk, "in_flight", ends_first)
    try:
        fetcher(store, tmp_path, bound=bound).fetch("c")
    finally:
        first.finish()
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {"b", "c"}


def test_what_this_vllm_resolved_is_unloaded_from_it_before_its_files_go(
    store: FakeS3, tmp_path: Path
) -> None:
    size = len(adapter()["adapter_config.json"]) + len(WEIGHTS) + 200
    fetch = fetcher(store, tmp_path, bound=2 * size + size // 2)
    asked: list[str] = []

    def unload(name: str) -> bool:  # vLLM's /v1/unload_lora_adapter; "b" cannot be unloaded
        asked.append(name)
        return name != "b"

    fetch.unload = unload
    fetch.fetch("a")
    fetch.fetch("b")
    fetch.fetch("c")
    assert asked == ["a"] and not (tmp_path / "a").exists()
    fetch.fetch("d")
    assert asked == ["a", "b", "c"]
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {"b", "d"}
    # Named again, "a" is fetched again.
    assert fetch.fetch("a") == tmp_path / "a"


Seen = list[tuple[str, str, str | None]]


@contextlib.contextmanager
def _http_server(answers: dict[str, int]) -> Iterator[tuple[str, Seen]]:
    """A loopback server answering each POST by its ``lora_name`` (500 for others): its URL,
    and each request's path, name and ``authorization`` header."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: Seen = []

    class Server(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, body["lora_name"], self.headers.get("authorization")))
            self.send_response(answers.get(body["lora_name"], 500))
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_unload_is_vllms_route() -> None:
    from lora_bucket.resolver import unloader

    with _http_server({"loaded": 200, "unknown": 404}) as (url, seen):
        unload = unloader(url, "sk-key")
        assert [unload(name) for name in ("loaded", "unknown", "broken")] == [True, True, False]
    assert seen[0] == ("/v1/unload_lora_adapter", "loaded", "Bearer sk-key")
    from tests.conftest import free_port

    assert unloader(f"http://127.0.0.1:{free_port()}")("x") is False  # no vLLM there


def test_the_unload_never_goes_through_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a proxy in the environment, the call to this machine's vLLM goes to vLLM: the
    proxy never sees vLLM's API key, and its answer never counts as an unload."""
    from lora_bucket.resolver import unloader

    with _http_server({"loaded": 200, "held": 200}) as (proxy, through_proxy), \
            _http_server({"loaded": 200, "held": 500}) as (vllm, at_vllm):
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        unload = unloader(vllm, "sk-key")
        assert [unload("loaded"), unload("held")] == [True, False]
    assert through_proxy == []
    assert at_vllm == [("/v1/unload_lora_adapter", "loaded", "Bearer sk-key"),
                       ("/v1/unload_lora_adapter", "held", "Bearer sk-key")]


def test_a_folder_that_cannot_hold_the_adapter(store: FakeS3, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(AdapterError) as raised:
        fetcher(store, tmp_path / "file" / "root").fetch("sql")
    assert no_secret(str(raised.value)).startswith(
        "The adapter 'sql' in s3://adapters/loras could not be written to LORA_ADAPTERS_DIR, ")
    assert "set LORA_ADAPTERS_DIR to a writable folder" in str(raised.value)


def test_an_adapter_larger_than_the_bound_is_refused(store: FakeS3, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="Fix: raise LORA_ADAPTERS_DISK_GIB"):
        fetcher(store, tmp_path, bound=100).fetch("sql")


# -- the resolver in vLLM's registry (vLLM's two classes stood in for) ------------------------
class _Request:
    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str) -> None:
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


class _Registry:
    def __init__(self) -> None:
        self.resolvers: dict[str, object] = {}

    def register_resolver(self, name: str, resolver: object) -> None:
        self.resolvers[name] = resolver


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> _Registry:
    """vLLM 0.32's ``LoRAResolver``, ``LoRAResolverRegistry`` and ``LoRARequest``, as the
    resolver uses them (vLLM is not in the tests' Python; the real one: test_e2e_adapters)."""
    import types

    registry = _Registry()
    resolver = types.ModuleType("vllm.lora.resolver")
    resolver.LoRAResolver = object  # type: ignore[attr-defined]
    resolver.LoRAResolverRegistry = registry  # type: ignore[attr-defined]
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = _Request  # type: ignore[attr-defined]
    for name, module in (("vllm", types.ModuleType("vllm")),
                         ("vllm.lora", types.ModuleType("vllm.lora")),
                         ("vllm.lora.resolver", resolver), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)
    return registry


async def test_vllm_asks_the_folder_then_the_bucket_then_the_hub(
    store: FakeS3, tmp_path: Path, registry: _Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lora_bucket.resolver import register

    folder = tmp_path / "loras"
    (folder / "sql").mkdir(parents=True)  # the user's folder has "sql": the bucket is not asked
    for name, value in {**store.env(), "LORA_ADAPTERS_URI": f"s3://{BUCKET}/{PREFIX}",
                        "LORA_ADAPTERS_DIR": str(tmp_path / "fetched"),
                        "VLLM_LORA_RESOLVER_CACHE_DIR": str(folder)}.items():
        monkeypatch.setenv(name, value)
    registry.register_resolver("Hf Hub Resolver", object())  # vLLM may load it first
    registry.register_resolver("Filesystem Resolver", object())
    register()
    assert list(registry.resolvers) == ["Filesystem Resolver", "Bucket Resolver",
                                        "Hf Hub Resolver"]
    bucket: Any = registry.resolvers["Bucket Resolver"]
    found = await bucket.resolve_lora(BASE, "chat")
    assert isinstance(found, _Request) and found.lora_name == "chat"
    assert found.lora_path == str(tmp_path / "fetched" / BUCKET / PREFIX / "chat")
    assert await bucket.resolve_lora(BASE, "sql") is None
    assert await bucket.resolve_lora(BASE, "acme/chat") is None
    with pytest.raises(AdapterError, match="base model 'org/another'"):
        await bucket.resolve_lora(BASE, "other-base")
    assert not (tmp_path / "fetched" / BUCKET / PREFIX / "sql").exists()


def test_without_the_uri_the_plugin_registers_nothing(
    registry: _Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lora_bucket.resolver import register

    monkeypatch.delenv("LORA_ADAPTERS_URI", raising=False)
    register()
    assert registry.resolvers == {}
