"""Convert a Hugging Face folder to a bf16 GGUF with llama.cpp's own converter, for latency.py's
--engine llamacpp (run it with the Python of llama.cpp's venv, ../shared/peers/README.md):

    python benchmarks/to_gguf.py --llama-cpp SRC /tmp/llama-250m /tmp/llama-250m-bf16.gguf

SRC is llama.cpp's source tree, the one holding convert_hf_to_gguf.py and gguf-py (in the
llama-cpp-python sdist: vendor/llama.cpp). The converter names a BPE tokenizer's pre-tokenizer
from a hash of how it splits a test text, and stops on one it does not know, as it does on
make_model.py's (the default model's tokenizer cut to the model's vocabulary). The benchmarks
hand llama.cpp token ids, never text, so here the name is given: SmolLM's, whose tokenizer it is.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp's source tree")
    parser.add_argument("model", help="a Hugging Face folder")
    parser.add_argument("out", help="the GGUF file to write")
    args = parser.parse_args()
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    if not converter.is_file():
        parser.error(f"{converter} not found: --llama-cpp should be llama.cpp's source tree")
    sys.path[:0] = [str(args.llama_cpp), str(args.llama_cpp / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's converter package, found through sys.path

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
    sys.argv = [str(converter), args.model, "--outtype", "bf16", "--outfile", args.out]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
