"""Batch jobs through the real worker process (``python -m worker``, the real runpod SDK loop
over tests/fake_job_api.py) to the stand-in vLLM (tests/fake_vllm.py): what a batch's results
become when its output_url never takes them. The batch's lines against the real vLLM are
tests/test_e2e_batch.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.fake_job_api import FakeJobApi
from tests.fake_vllm import free_port, launch_worker

#: A line's prompt: the stand-in echoes the request in its answer, so that 11 lines' results
#: pass the 10 MB Runpod keeps of a /run job's result.
PROMPT = "x" * 1_000_000


def test_results_an_output_url_never_took_are_kept_on_the_volume_and_the_error_names_them(
    tmp_path: Path,
) -> None:
    """A presigned https:// output_url that cannot be reached (a closed port on loopback): the
    write is tried three times, then the 11 MB of results, too large for the job's result,
    are kept in a file on the volume (BASE_PATH), and the job fails naming that file and why
    the write failed; the URL's signature is quoted nowhere."""
    volume = tmp_path / "volume"
    volume.mkdir()
    output_url = f"https://127.0.0.1:{free_port()}/out.jsonl?X-Amz-Signature=SECRET"
    lines = [{"custom_id": f"line-{n}", "url": "/v1/completions",
              "body": {"prompt": PROMPT, "max_tokens": 1}} for n in range(11)]
    with FakeJobApi() as api:
        worker = launch_worker(api.env(), tmp_path, model="m", concurrency=2,
                               extra_env={"BASE_PATH": str(volume),
                                          "WORKER_LOG_LEVEL": "INFO"})
        try:
            record = api.wait_done(api.submit({"batch": lines, "output_url": output_url}),
                                   timeout=180)
        finally:
            worker.kill()
    error = record.error
    assert error is not None and error["type"] == "invalid_request", record.done
    [path] = (volume / "batch-results").iterdir()
    assert error["results_file"] == str(path) and error["param"] == "output_url"
    assert (error["done"], error["total"], error["errors"]) == (11, 11, 0)
    assert error["message"] == (
        f"'output_url' {output_url.split('?')[0]}?... cannot be reached (ConnectError), "
        f"tried 3 times. The 11 results ({path.stat().st_size:,} bytes, more than the job's "
        f"output holds) are kept in {path}, on the network volume at {volume}.")
    results = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted(result["custom_id"] for result in results) == sorted(
        f"line-{n}" for n in range(11))
    for result in results:  # every answer whole
        assert result["error"] is None and result["response"]["status_code"] == 200
        assert result["response"]["body"]["echo"]["prompt"] == PROMPT
    assert path.stat().st_size > 10_000_000
    log = worker.log()
    assert f"are kept in {path}, on the network volume at {volume}" in log
    assert "SECRET" not in log and "SECRET" not in json.dumps(record.done)
