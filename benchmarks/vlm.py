"""Images through the engine against transformers' generate on the same model and batch: a random
Qwen2-VL with a vision tower of SigLIP-base's size (768 wide, 12 layers, 12 heads, 14 px patches)
and a ~250M language model (Qwen2: 1024 wide, 16 layers, 16/4 heads), 16 requests of one 448x448
image (1024 patches, 256 tokens after the 2x2 merge) and about 64 text tokens, 64 tokens out.

    .venv/bin/python benchmarks/vlm.py --rounds 3

Each round runs both, alternated, on fresh pictures (no encoder-cache or prefix-cache hits across
rounds): pagedllm's LLMEngine stepped to record each request's first token; transformers'
generate on the batch (min_new_tokens = max_new_tokens, as ignore_eos), a streamer recording its
first token. --busy 0,1 runs each round quiet, then beside one busy process (`while True: pass`,
contention.py's), and gives each engine's speed kept of quiet.

Prints output tok/s, TTFT (median over the requests; transformers' batch has one) and their
ratios; the encoder's rate (its matmul FLOPs over its whole time per image, so norms, activations
and softmax count against it) as a share of F.linear's rate at the encoder's largest shape,
measured in the same run; both engines' rates over the batch's matmul work; and the ratio the
machine allows at most: transformers' time over the work's time at the best GEMM rate measured
(that F.linear, or a 2048x2048 matmul). --dtype: the engine's choice ("auto": bf16 where the CPU
has AVX512-BF16, else fp32), both engines alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

from common import Busy, measure_matmul_gflops  # noqa: E402  (benchmarks/, the script's own folder)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4
)
VISION = dict(depth=12, embed_dim=768, num_heads=12, mlp_ratio=4, patch_size=14)


def make_model(path: Path) -> None:
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from conftest import _DEFAULT_GGUF, default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=_DEFAULT_GGUF)
    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    start, image, end, video = tokenizer.convert_tokens_to_ids(specials)
    text = {
        **TEXT,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 8, 8]},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={**VISION, "hidden_size": TEXT["hidden_size"]},
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    Qwen2VLImageProcessorPil().save_pretrained(path)  # (448x448 is within its default pixel range)
    tokenizer.save_pretrained(path)


def pictures(seed: int, count: int, size: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def prompt(i: int, words: int) -> str:
    rng = np.random.default_rng(1000 + i)
    vocabulary = "river stone city road field garden window morning winter summer music story paper".split()
    return f"{IMAGE}Describe the picture: " + " ".join(rng.choice(vocabulary, words))


def run_ours(llm, images: list, args) -> tuple[float, list[float]]:
    """Wall time and each request's time to its first token."""
    from pagedllm import SamplingParams
    from pagedllm.multimodal.processing import ImagePrompt

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [
        engine.add_request(None, ImagePrompt(prompt(i, args.words), (image,)), params) for i, image in enumerate(images)
    ]
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - start
    return time.perf_counter() - start, [first[i] for i in ids]


class FirstToken:
    """transformers' streamer protocol: put() gets the prompt, then each step's tokens."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None
        self.start = time.perf_counter()

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def run_theirs(hf, images: list, args) -> tuple[float, float]:
    model, processor = hf
    texts = [prompt(i, args.words) for i in range(len(images))]
    start = time.perf_counter()
    inputs = processor(text=texts, images=images, return_tensors="pt", padding=True)
    streamer = FirstToken()
    streamer.start = start
    with torch.no_grad():
        model.generate(
            **inputs,
            max_new_tokens=args.output_tokens,
            min_new_tokens=args.output_tokens,
            do_sample=False,
            streamer=streamer,
        )
    return time.perf_counter() - start, streamer.first


def encoder_share(llm, dtype: torch.dtype, size: int) -> tuple[float, float, float]:
    """(the encoder's matmul GFLOP/s over its whole time for one image, F.linear's GFLOP/s at its
    fc1 shape, the share)."""
    import torch.nn.functional as F

    model = llm.engine.model_runner.model
    processor = llm.engine.images
    (data,) = processor._images(pictures(7, 1, size))
    patches = data["pixel_values"].shape[0]
    e, layers, m = VISION["embed_dim"], VISION["depth"], VISION["embed_dim"] * VISION["mlp_ratio"]
    macs = patches * 3 * 2 * VISION["patch_size"] ** 2 * e  # the patch embedding
    macs += layers * patches * (4 * e * e + 2 * e * m + 2 * patches * e)  # q/k/v/o, the MLP, attention
    macs += patches // 4 * (4 * e) ** 2 + patches // 4 * 4 * e * TEXT["hidden_size"]  # the merger
    times = []
    with torch.inference_mode():
        model.encode_image(data)
        for _ in range(3):
            start = time.perf_counter()
            model.encode_image(data)
            times.append(time.perf_counter() - start)
    encoder = 2 * macs / statistics.median(times) / 1e9
    x, w = torch.randn(patches, e, dtype=dtype), torch.randn(m, e, dtype=dtype)
    F.linear(x, w)
    gemm = []
    for _ in range(5):
        start = time.perf_counter()
        F.linear(x, w)
        gemm.append(2 * patches * e * m / (time.perf_counter() - start) / 1e9)
    rate = statistics.median(gemm)
    return encoder, rate, encoder / rate


def work_flops(args, patches: int, prompt_tokens: int) -> float:
    """The batch's matmul FLOPs: encoders, the language model's prefill and decode (its linear
    layers and the head for each sampled token; attention left out: it is small here)."""
    e, layers, m = VISION["embed_dim"], VISION["depth"], VISION["embed_dim"] * VISION["mlp_ratio"]
    encoder = patches * (3 * 2 * VISION["patch_size"] ** 2 * e + layers * (4 * e * e + 2 * e * m + 2 * patches * e))
    encoder += patches // 4 * ((4 * e) ** 2 + 4 * e * TEXT["hidden_size"])
    h, kv = TEXT["hidden_size"], TEXT["hidden_size"] // TEXT["num_attention_heads"] * TEXT["num_key_value_heads"]
    per_token = TEXT["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * TEXT["intermediate_size"])
    tokens = prompt_tokens + args.output_tokens
    head = 49156 * h * (args.output_tokens + 1)
    return 2.0 * args.requests * (encoder + per_token * tokens + head)


def measure(llm, dtype, args, flops, ours_wall, ours_ttft, theirs_wall, theirs_ttft, rates: bool) -> dict:
    """A round's figures; with `rates`, the encoder's and the GEMMs' too (quiet rounds only)."""
    out = args.requests * args.output_tokens
    row = {
        "ours tok/s": out / ours_wall,
        "theirs tok/s": out / theirs_wall,
        "throughput ratio": theirs_wall / ours_wall,
        "ours TTFT s (median)": statistics.median(ours_ttft),
        "theirs TTFT s": theirs_ttft,
        "TTFT ratio": theirs_ttft / statistics.median(ours_ttft),
        "ours GFLOP/s": flops / ours_wall / 1e9,
        "theirs GFLOP/s": flops / theirs_wall / 1e9,
    }
    if rates:
        encoder, gemm, share = encoder_share(llm, dtype, args.image_size)
        best = max(gemm, measure_matmul_gflops(dtype))
        # The most the machine allows: the work at the best GEMM rate, against transformers' time.
        row.update(
            {
                "encoder GFLOP/s": encoder,
                "F.linear GFLOP/s": gemm,
                "encoder share": share,
                "best GEMM GFLOP/s": best,
                "ratio ceiling": theirs_wall / (flops / best / 1e9),
            }
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedllm-vlm-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--words", type=int, default=56, help="text words a prompt (about 64 tokens with the image's)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--busy", default="0", help="levels of contention each round: busy processes beside both")
    args = parser.parse_args()
    if not (args.model_dir / "config.json").exists():
        make_model(args.model_dir)
    from pagedllm import LLM
    from vlm_utils import load_hf_qwen2_vl

    llm = LLM(str(args.model_dir), dtype=args.dtype, max_model_len=2048, max_num_batched_tokens=2048)
    dtype = getattr(torch, llm.engine.model_config.dtype)
    model, processor = load_hf_qwen2_vl(str(args.model_dir))
    hf = (model.to(dtype), processor)
    print(f"dtype {dtype}; torch threads {torch.get_num_threads()}")
    first = processor(text=[prompt(0, args.words)], images=pictures(0, 1, args.image_size), return_tensors="pt")
    prompt_tokens, patches = first["input_ids"].shape[1], int(first["image_grid_thw"][0].prod())
    print(f"a request: {prompt_tokens} prompt tokens ({patches} patches), {args.output_tokens} out")
    flops = work_flops(args, patches, prompt_tokens)
    levels = [int(n) for n in args.busy.split(",")]
    rows: dict[int, list[dict]] = {level: [] for level in levels}
    for r in range(args.rounds):
        for level in levels:
            with Busy(level):
                seed = 100 * (r + 1) + 10 * level
                ours_wall, ours_ttft = run_ours(llm, pictures(seed, args.requests, args.image_size), args)
                theirs_wall, theirs_ttft = run_theirs(hf, pictures(seed + 5, args.requests, args.image_size), args)
                row = measure(llm, dtype, args, flops, ours_wall, ours_ttft, theirs_wall, theirs_ttft, level == 0)
            rows[level].append(row)
            print(f"round {r + 1}, {level} busy: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    for level, level_rows in rows.items():
        print(f"\n{level} busy: medians of {args.rounds} rounds (range):")
        for key in level_rows[0]:
            values = [row[key] for row in level_rows]
            print(f"  {key}: {statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        if level:
            for key in ("ours tok/s", "theirs tok/s"):
                kept = [busy[key] / quiet[key] for busy, quiet in zip(level_rows, rows[0])]
                print(f"  {key} kept of quiet: {statistics.median(kept):.2f} ({min(kept):.2f}-{max(kept):.2f})")
    print(f"the batch's matmul work: {flops / 1e12:.2f} TFLOP")


if __name__ == "__main__":
    main()
