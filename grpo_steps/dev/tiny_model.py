"""The tiny random test policy ``embedded:tiny-random-qwen2``: built locally in seconds, no download.

For tests and smoke runs (``configs/test*.yaml``); :func:`grpo_steps.models.resolve_model` imports this
module only when that name is asked for. A production run never uses it.
"""

from __future__ import annotations

from pathlib import Path

from grpo_steps.weights.files import save_model_dir

TINY = "tiny-random-qwen2"
"""Name of the tiny policy after ``embedded:`` in ``model.name_or_path``."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen2 uses it, over the tiny tokenizer's special tokens."""


def build_tiny(target: Path, seed: int = 0) -> Path:
    """Build the tiny policy into ``target`` (a safetensors checkpoint directory, replaced atomically)
    and return ``target``.

    A random Qwen2 (2 layers, hidden 128, head_dim 64, ~370-token vocabulary, 0.34 M parameters) with a
    byte-level BPE tokenizer trained here on arithmetic text and a ChatML template, then warmed up for a
    few seconds (:func:`_warm_up_tiny`). Same seed -> same weights. Takes ~20 s on 2 CPU cores.
    """
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
    return save_model_dir(model, tokenizer, target)


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
