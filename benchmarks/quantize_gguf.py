"""Quantize a GGUF file with llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize), as
llama.cpp's users make their Q8_0 and Q4_K_M files. Run it with the Python of llama.cpp's venv
(../shared/peers/README.md):

    ~/peers/llamacpp/bin/python benchmarks/quantize_gguf.py /tmp/llama-250m-bf16.gguf \
        /tmp/llama-250m-Q4_K_M.gguf Q4_K_M
"""

from __future__ import annotations

import argparse
import ctypes
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an F16/BF16/F32 GGUF file")
    parser.add_argument("out")
    parser.add_argument("type", help="a llama.cpp file type: Q8_0, Q4_K_M, Q4_0, Q5_K_M, Q6_K, ...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--allow-requantize", action="store_true", help="a quantized source (a file of real weights in another type)"
    )
    args = parser.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        parser.error(f"llama.cpp knows no file type {args.type!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = args.threads
    params.allow_requantize = args.allow_requantize
    start = time.perf_counter()
    code = llama_cpp.llama_model_quantize(args.source.encode(), args.out.encode(), ctypes.byref(params))
    if code != 0:
        raise SystemExit(f"llama_model_quantize failed ({code})")
    print(f"wrote {args.out} ({args.type}) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
