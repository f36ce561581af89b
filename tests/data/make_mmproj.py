"""Makes tests/data's vision projector (mmproj) files with llama.cpp's own converter, from the tiny
models' vision weights (vlm_utils: their own seeded generator, whatever the text model).

    python tests/data/make_mmproj.py SRC    # SRC: llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)

llama-cpp-python's source distribution has it under vendor/llama.cpp (`pip download --no-binary
:all: --no-deps llama-cpp-python`). transformers saves the tower as `vision_tower.*`; the converter
reads the original files' `vision_tower.vision_model.*`, so the folder is renamed first."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def as_original_files(folder: Path, out: Path) -> None:
    """The folder as the original checkpoints lay it out: the tower's tensors under
    vision_tower.vision_model., the image processor's settings in preprocessor_config.json."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    processor = json.loads((folder / "processor_config.json").read_text())
    settings = {**processor.get("image_processor", {}), "image_seq_length": processor.get("image_seq_length")}
    (out / "preprocessor_config.json").write_text(json.dumps(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("llama_cpp", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from conftest import _DEFAULT_GGUF, default_model_dir
    from vlm_utils import make_gemma3_vl, make_qwen2_vl

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=_DEFAULT_GGUF).save_pretrained(work / "tok")
        make_gemma3_vl(work / "gemma3", str(work / "tok"))
        as_original_files(work / "gemma3", work / "gemma3-original")
        make_qwen2_vl(work / "qwen2-vl-original", str(work / "tok"))  # (saved in the original layout)
        env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
        converter = [sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py")]
        for family in ("gemma3", "qwen2-vl"):
            out = HERE / f"{family}-tiny-mmproj-f32.gguf"
            options = ["--mmproj", "--outtype", "f32", "--outfile", str(out)]
            subprocess.run([*converter, str(work / f"{family}-original"), *options], check=True, env=env)
            print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
