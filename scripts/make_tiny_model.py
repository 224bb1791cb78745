#!/usr/bin/env python3
# mypy: disable-error-code="no-untyped-call"
"""Build a tiny random-weight Llama model folder that the real `vllm serve` can load.

    python scripts/make_tiny_model.py OUT_DIR [--seed N] [--lora LORA_DIR]

Why: tests and CI must start a real vLLM server on a CPU-only machine that cannot reach the
Hugging Face hub. Every file is produced locally from code in this script, so nothing is
downloaded, the folder is about 1.3 MB, vLLM loads it in well under a second (its start is
dominated by imports), and the same seed gives byte-identical files (cacheable by hash).

What it writes (the layout of a Hugging Face checkpoint):

* ``model.safetensors`` + ``config.json``: a ``LlamaForCausalLM`` with 2 layers, hidden size
  128, 4 attention heads of size 32 (vLLM's CPU attention needs head_dim >= 32), 4 KV heads,
  MLP size 256, 2048 positions, random weights from ``torch.manual_seed(seed)``, stored as
  bfloat16 (a dtype the CPU build of vLLM serves as is; fp32 would double the size for no
  benefit). The safetensors header carries only the fixed metadata ``{"format": "pt"}``.
* ``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja``: a byte-level
  BPE tokenizer (~1k tokens) trained with the ``tokenizers`` library on the small English
  corpus below, with ``<s>``/``</s>``/``<pad>``/``<unk>`` and role markers as special
  tokens, and a role-tagged (Zephyr-like) chat template supporting system/user/assistant
  messages and ``add_generation_prompt``. The template is in ``chat_template.jinja`` (what
  transformers reads first) and also in ``tokenizer_config.json`` (for older readers).
* ``generation_config.json``: only the bos/eos/pad ids, so vLLM takes no sampling defaults
  from it.

With ``--lora LORA_DIR``, a LoRA adapter for that model goes into LORA_DIR too (PEFT's
layout: ``adapter_config.json`` + ``adapter_model.safetensors``, rank 8 on ``q_proj`` and
``v_proj``, seeded random weights), so that vLLM's ``--lora-modules`` can serve it.

The output is gibberish by design: the tests need a real server, not a good model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK, *ROLE_TOKENS]
VOCAB_SIZE = 1024
MAX_POSITIONS = 2048

# Renders e.g. "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n".
# bos_token/eos_token are output, never concatenated with "+": vLLM's /v1/messages probes the
# template without them, and an undefined operand of "+" would make it think that system
# messages must come first.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = """\
Hello! How are you today? I am fine, thank you. What can I do for you?
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
Once upon a time there was a little village by the sea, where fishermen sailed every morning.
The weather is nice today, so we are going to the park to play football and have a picnic.
Please write a short story about a robot who learns to paint pictures of flowers.
Can you explain how a computer works? A computer reads instructions and processes data.
The server started, loaded the model, and answered the first request in less than a second.
Water boils at one hundred degrees Celsius and freezes at zero degrees at sea level.
She opened the window, looked at the mountains, and decided to climb the highest one.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, 1, 2, 3, 42, 100, 2024.
The system is a helpful assistant. The user asks a question and the assistant answers it.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
Learning a new language takes time, patience, and a lot of practice with other people.
He said that the train would arrive at seven o'clock, but it was late again this evening.
Good morning, good afternoon, good evening, and good night to everyone who reads this.
They built a small house with a red roof, a green door, and a garden full of vegetables.
Reading books is one of the best ways to learn about history, science, and the world.
The children laughed and ran across the field, chasing a yellow kite in the strong wind.
If you have any questions, feel free to ask; I will try my best to help you quickly.
Tokens are pieces of words; a tokenizer splits text into tokens and maps them to numbers.
A model predicts the next token from the previous ones, one step at a time, until it stops.
Music, art, and stories make people happy, and they bring friends and families together.
The library opens at nine in the morning and closes at six in the evening on weekdays.
Our team tested the new version carefully, fixed three bugs, and released it on Friday.
Bread, milk, eggs, cheese, apples, and oranges are on the shopping list for this week.
The doctor told him to drink more water, sleep eight hours, and walk every single day.
In the winter the lake freezes, and in the summer people swim and sail boats on it.
Thank you very much for your help; I really appreciate the time you spent with me.
Why is the sky blue? Sunlight is scattered by the air, and blue light scatters the most.
Write a poem about the moon, the stars, and the quiet night over the sleeping town.
Yes, no, maybe, always, never, sometimes, often, rarely, usually, and perhaps later.
The meeting was moved to Tuesday because several people were traveling on Monday.
Cats and dogs, birds and fish, horses and cows all live on the farm near the river.
A good answer is short, clear, correct, and polite, and it respects the question asked.
The engine is ready, the cache is warm, and the queue is empty, so the worker waits.
Summer, autumn, winter, spring: the seasons change, and the trees change their colors.
Please summarize the following text in one sentence and list the three main ideas.
The student solved the math problem: twelve plus thirty equals forty-two, of course.
We walked along the beach, collected shells, and watched the sun go down over the waves.
Open the file, read each line, count the words, and print the total at the end.
"""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on CORPUS; deterministic for a given corpus."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    # Like Llama: a prompt starts with <s>; the chat template writes <s> itself, and vLLM
    # tokenizes rendered chats without special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id), (EOS, eos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(tokenizer: PreTrainedTokenizerFast, **more: Any) -> LlamaConfig:
    """The tiny Llama's configuration (also the language model of make_tiny_vlm.py's)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **more,
    )


def random_model(model_class: Any, config: Any, tokenizer: Any, seed: int) -> Any:
    """``model_class(config)`` with weights from ``torch.manual_seed(seed)``, cast to bfloat16,
    whose generation config holds only the tokenizer's ids (vLLM takes no sampling defaults)."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.bfloat16()  # casts in place
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama with seeded random weights, cast to bfloat16."""
    model: LlamaForCausalLM = random_model(LlamaForCausalLM, llama_config(
        tokenizer, dtype="bfloat16"), tokenizer, seed)
    return model


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Save ``tokenizer`` (or a processor holding it) with CHAT_TEMPLATE, readable by
    transformers 4 and 5."""
    tokenizer.save_pretrained(out_dir)
    # Also keep the template inside tokenizer_config.json, for readers that look only there.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes its own class name "TokenizersBackend", unknown to transformers 4
    # (e.g. in older vLLM images); both versions load "PreTrainedTokenizerFast".
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )


def save_model(model: Any, out_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "model.safetensors").chmod(0o644)  # written 0600; make it like the other files


def make_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write the model folder into out_dir (created if missing) and return it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    save_tokenizer(tokenizer, out_dir)
    save_model(build_model(tokenizer, seed), out_dir)
    return out_dir


LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def make_tiny_lora(out_dir: Path, base_model: Path, seed: int = 0) -> Path:
    """Write a LoRA adapter for the tiny model (as PEFT saves one) into ``out_dir``."""
    from safetensors.torch import save_file

    config = json.loads((base_model / "config.json").read_text(encoding="utf-8"))
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    out_features = {"q_proj": config["num_attention_heads"] * config["head_dim"],
                    "v_proj": config["num_key_value_heads"] * config["head_dim"]}
    generator = torch.Generator().manual_seed(seed + 1)
    weights = {}
    for layer in range(layers):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, hidden,
                                                             generator=generator) * 0.02
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out_features[target], LORA_RANK,
                                                             generator=generator) * 0.02
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(LORA_TARGETS), "base_model_name_or_path": str(base_model),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n",
                                                 encoding="utf-8")
    return out_dir


def builder_cli(doc: str, make: Callable[[Path, int], Path],
                argv: list[str] | None = None) -> None:
    """The command line of a builder beside this one: ``OUT_DIR [--seed N]``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    print(make(args.out_dir, args.seed).resolve())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--lora", type=Path, help="also write a LoRA adapter into this folder")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    print(make_tiny_model(args.out_dir, args.seed).resolve())
    if args.lora is not None:
        print(make_tiny_lora(args.lora, args.out_dir, args.seed).resolve())


if __name__ == "__main__":
    main()
