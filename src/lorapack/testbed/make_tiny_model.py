"""Write the testbed's tiny model, tokenizer and LoRA adapters (run by the *testbed's* Python, not lorapack's).

    <testbed python> make_tiny_model.py OUT_DIR [--seed 0]

Nothing is downloaded: the tokenizer is a byte-level BPE trained with ``tokenizers`` on a seeded synthetic
corpus, the model a 2-layer Llama with random weights from ``transformers``, each adapter a random-weight PEFT
LoRA on q/k/v/o (``init_lora_weights=False``: B is not zero, so an adapter changes the output). The same seed
gives the same files. This file imports torch: lorapack never imports it (``lorapack.testbed.env`` runs it in
the testbed's environment, docs/testbed.md).

Layout written (``OUT_DIR/manifest.json`` last, so a half-written directory has none):
    OUT_DIR/model/                      config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    OUT_DIR/adapters/<id>/              adapter_config.json, adapter_model.safetensors
    OUT_DIR/manifest.json               {"model": ..., "adapters": [{"adapter_id", "rank", "path"}], ...}
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

# The model: small enough to start in about a minute and step in milliseconds on one CPU core, shaped like a
# Llama (grouped KV heads: 4 query heads share 2 KV heads; head size 32, one the CPU attention backend takes).
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 2000
MAX_POSITIONS = 131072  # the Llama profile's --max-model-len: serve.sh of a shipped plan must start on it
# Adapters: ADAPTERS_PER_RANK of each rank, ids "r<rank>-<k>" (k = 0, 1, ...), registered in that order.
RANKS = (8, 16, 32, 64)
ADAPTERS_PER_RANK = 3
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]


def corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Seeded synthetic text: ASCII words of 1-9 letters, Zipf-like word frequencies."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choice(letters[: 6 + i % 20]) for _ in range(1 + i % 9)) for i in range(3000)]
    weights = [1.0 / (1 + i) for i in range(len(words))]
    return [" ".join(rng.choices(words, weights, k=rng.randint(5, 30))) for _ in range(n_lines)]


def write_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=MAX_POSITIONS)
    fast.save_pretrained(out)


def write_model(out: Path, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return model


def write_adapters(model, out: Path, seed: int) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model

    written = []
    for rank in RANKS:
        for k in range(ADAPTERS_PER_RANK):
            adapter_id = f"r{rank}-{k}"
            torch.manual_seed(seed * 1000 + rank * 10 + k + 1)
            cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, lora_dropout=0.0,
                             bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
            peft_model = get_peft_model(model, cfg)
            path = out / adapter_id
            peft_model.save_pretrained(path, safe_serialization=True)
            model = peft_model.unload()  # the base model back, without this adapter's layers
            written.append({"adapter_id": adapter_id, "rank": rank, "path": str(path)})
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "model").mkdir(parents=True)
    write_tokenizer(out / "model", args.seed)
    model = write_model(out / "model", args.seed)
    adapters = write_adapters(model, out / "adapters", args.seed)
    manifest = {"model": str(out / "model"), "seed": args.seed, "adapters": adapters,
                "shape": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                          "vocab": VOCAB}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"tiny model and {len(adapters)} adapters written to {out}")


if __name__ == "__main__":
    main()
