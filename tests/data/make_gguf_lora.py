"""Makes tests/data's GGUF LoRA adapter with llama.cpp's own converter (convert_lora_to_gguf.py),
from a PEFT adapter of the tests' tiny Llama's shape (lora_utils: random A and B of its own seed,
whatever the base weights).

    python tests/data/make_gguf_lora.py SRC    # SRC: llama.cpp's source tree (convert_lora_to_gguf.py, gguf-py)

llama-cpp-python's source distribution has it under vendor/llama.cpp (`pip download --no-binary
:all: --no-deps llama-cpp-python`). The converter reads only the base model's config.json."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

OUT = HERE / "llama-tiny-lora-f32.gguf"
# The adapter test_lora.py makes again with make_adapter: rank 8, every target, this seed.
RANK, SEED = 8, 47


def tiny_llama_config():
    """conftest's tiny Llama's config (the tokenizer's 49,152 entries)."""
    from conftest import _config

    return _config("llama", vocab_size=49152)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="llama.cpp's source tree")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from lora_utils import adapter_of

    with tempfile.TemporaryDirectory() as tmp:
        base, adapter = Path(tmp) / "base", Path(tmp) / "adapter"
        config = tiny_llama_config()
        config.architectures = ["LlamaForCausalLM"]  # (how the converter picks its model class)
        config.save_pretrained(base)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        adapter_of(model, adapter, rank=RANK, seed=SEED)
        env = {**os.environ, "PYTHONPATH": str(Path(args.src) / "gguf-py")}
        command = [sys.executable, str(Path(args.src) / "convert_lora_to_gguf.py"), "--base", str(base)]
        command += ["--outtype", "f32", "--outfile", str(OUT), str(adapter)]
        subprocess.run(command, check=True, env=env)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
