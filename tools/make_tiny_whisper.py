#!/usr/bin/env python3
# mypy: disable-error-code="no-untyped-call"
"""Build a tiny random-weight Whisper model folder that the real `vllm serve` can load.

    python tools/make_tiny_whisper.py OUT_DIR [--seed N]

Why: the speech-to-text tests must serve vLLM's ``/v1/audio/transcriptions`` on a CPU-only
machine that cannot reach the Hugging Face hub. Like ``make_tiny_model.py`` (the tiny Llama),
every file is made here from code, the same seed gives the same files (cacheable by hash),
and the answers are gibberish by design: the tests need a real server, not a good model.

What it writes (the layout of a Hugging Face Whisper checkpoint):

* ``model.safetensors`` + ``config.json``: a ``WhisperForConditionalGeneration`` with 2
  encoder and 2 decoder layers, d_model 64 with 2 heads (head_dim 32, vLLM's CPU attention
  needs at least 32), FFN 128, 80 mel bins, Whisper's 1500 encoder positions (30 s of audio)
  and ``MAX_TARGET_POSITIONS`` decoder positions (vLLM's context), seeded random weights
  stored as bfloat16. The embedding of ``<|endoftext|>`` (which is also the output layer:
  the two are tied) is zero, so its logit is always 0 and greedy decoding, vLLM's default
  for transcriptions (temperature 0), never picks it over the largest of a thousand random
  logits: a transcription runs to ``max_completion_tokens`` or to the end of the context,
  which lets a test cancel one while it is still generating.
* ``tokenizer.json`` + ``tokenizer_config.json``: a ``WhisperTokenizer`` over a byte-level
  BPE (~1k tokens) trained with the ``tokenizers`` library on the tiny Llama's corpus, then
  Whisper's special tokens in Whisper's order: ``<|endoftext|>``, ``<|startoftranscript|>``,
  one ``<|xx|>`` per language Whisper knows, ``<|translate|>``, ``<|transcribe|>``,
  ``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>`` (no
  timestamp tokens: ``verbose_json`` is not served by this model).
* ``processor_config.json``: Whisper's feature extractor (80 mel bins, 16 kHz, hop 160,
  30 s chunks), so ``AutoProcessor`` loads a ``WhisperProcessor`` as vLLM expects.
* ``generation_config.json``: only the token ids, so vLLM takes no sampling defaults from it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES

# The tiny Llama's script stays beside the scripts a user runs (scripts/run_local.sh builds
# its model): the tiny Llama's corpus, one for both.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_tiny_model import (
    CORPUS,
    builder_cli,
)

EOT = "<|endoftext|>"
SOT = "<|startoftranscript|>"
NO_TIMESTAMPS = "<|notimestamps|>"
# Whisper's special tokens, in the order of its vocabulary.
SPECIAL_TOKENS = [
    EOT, SOT, *(f"<|{code}|>" for code in LANGUAGES),
    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
    NO_TIMESTAMPS,
]
BPE_VOCAB_SIZE = 1024
MAX_TARGET_POSITIONS = 2048
SAMPLING_RATE = 16000


def build_tokenizer() -> WhisperTokenizer:
    """A byte-level BPE trained on CORPUS, with Whisper's special tokens after it."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # WhisperTokenizer builds its BPE from a vocabulary and merges: the trained ones, read
    # from the tokenizer's JSON (the library exposes its merges nowhere else).
    merges = [tuple(merge) for merge in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = WhisperTokenizer(
        vocab=bpe.get_vocab(), merges=merges, unk_token=EOT, bos_token=EOT, eos_token=EOT,
        pad_token=EOT, model_max_length=MAX_TARGET_POSITIONS,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def build_model(tokenizer: WhisperTokenizer, seed: int) -> WhisperForConditionalGeneration:
    """The tiny Whisper with seeded random weights, <|endoftext|>'s embedding zero, bfloat16."""
    eot, sot = tokenizer.convert_tokens_to_ids([EOT, SOT])
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=MAX_TARGET_POSITIONS,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[eot].zero_()
    model.bfloat16()
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot,
    )
    return model


def make_tiny_whisper(out_dir: Path, seed: int = 0) -> Path:
    """Write the model folder into out_dir (created if missing) and return it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLING_RATE,
                                       hop_length=160, chunk_length=30, n_fft=400)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(out_dir)
    model = build_model(tokenizer, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "model.safetensors").chmod(0o644)  # written 0600; make it like the other files
    return out_dir


def main(argv: list[str] | None = None) -> None:
    builder_cli(__doc__, make_tiny_whisper, argv)


if __name__ == "__main__":
    main()
