"""The tiny model as a Hub repo, for the tests and the benchmark that start from a Hub.

``repo_files`` gives the files of the tiny model's folder (its LoRA adapter left out), and can
make its weights file larger: huggingface_hub writes a download 10 MiB at a time, so a download
whose progress is to be seen must be larger than that. The extra bytes are one more tensor,
named like the ``rotary_emb.inv_freq`` buffers some checkpoints carry, which vLLM's weight
loader drops (``AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``): the model served is
the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.fake_hub import read_folder

#: The repo id the tests serve the tiny model under.
REPO = "acme/tiny"
_UNUSED = "model.layers.0.self_attn.rotary_emb.inv_freq"


def pad_safetensors(data: bytes, extra: int) -> bytes:
    """A safetensors file with one more float32 tensor of about ``extra`` bytes of zeros."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    end = max(t["data_offsets"][1] for name, t in header.items() if name != "__metadata__")
    count = max(1, extra // 4)
    header[_UNUSED] = {"dtype": "F32", "shape": [count], "data_offsets": [end, end + 4 * count]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body[:end] + bytes(4 * count)


def repo_files(model: Path, *, extra_weight_bytes: int = 0) -> dict[str, bytes]:
    """The files of the tiny model as a repo (its weights ``extra_weight_bytes`` larger)."""
    files = {name: data for name, data in read_folder(model).items()
             if not name.startswith("lora/")}
    if extra_weight_bytes:
        files["model.safetensors"] = pad_safetensors(files["model.safetensors"],
                                                     extra_weight_bytes)
    return files
