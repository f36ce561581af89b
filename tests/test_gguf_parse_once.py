"""A GGUF model's config and tokenizer come from the one parse of the file its weights use, and equal
what transformers builds when it reads the file itself."""

from __future__ import annotations

import dataclasses
import os

import pytest

from gguf_writer import write_gguf
from pagedllm.config import head_dim
from pagedllm.models import gguf as gguf_file
from pagedllm.models.decoder import DecoderConfig
from pagedllm.models.loader import default_model_path, load_model_config
from pagedllm.tokenizer import load_tokenizer

# What the model and the engine read off the config.
CONFIG_ATTRS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "tie_word_embeddings",
    "sliding_window",
)
TEXTS = [
    "Hello  world 42 é",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> 日本語\t\n  x  ",
    " leading space and trailing  ",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _from_file(path: str):
    """The reference: transformers' own reading of the file (which parses it twice)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(path)
    return AutoConfig.from_pretrained(folder, gguf_file=name), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _ours(path: str):
    config = gguf_file.load_gguf_config(path)
    return config, gguf_file.load_gguf_tokenizer(path, config)


def _rope_theta(config) -> float:
    # transformers 5 keeps it in rope_parameters, 4.x as an attribute.
    return getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]


def _assert_same_config(ours, reference, ignore: tuple[str, ...] = ()) -> None:
    """Equal in every field the model and the engine read (ours is not transformers' per-model class:
    models/gguf_config.py), the layers' derived shapes and windows included."""
    for attr in CONFIG_ATTRS:
        if attr not in ignore:
            assert getattr(ours, attr, None) == getattr(reference, attr, None), attr
    if "head_dim" not in ignore:
        assert head_dim(ours) == head_dim(reference)
    assert _rope_theta(ours) == _rope_theta(reference)
    assert ours.rope_parameters == reference.rope_parameters
    assert ours.hidden_act == reference.hidden_act
    if not ignore:
        for flags in ((False, False), (True, False), (False, True)):
            assert DecoderConfig.of(ours, *flags) == DecoderConfig.of(reference, *flags)


def _assert_same_tokenizer(ours, reference) -> None:
    assert type(ours) is type(reference)
    for text in TEXTS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            assert ours.decode(ids) == reference.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == reference.chat_template
    for generation_prompt in (True, False):
        kwargs = dict(add_generation_prompt=generation_prompt, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, **kwargs) == reference.apply_chat_template(MESSAGES, **kwargs)
    assert (ours.eos_token, ours.eos_token_id) == (reference.eos_token, reference.eos_token_id)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.added_tokens_decoder == reference.added_tokens_decoder
    assert len(ours) == len(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()


@pytest.fixture(scope="module")
def default_gguf() -> str:
    return default_model_path()


def test_default_model_config_and_tokenizer_equal_transformers_reading(default_gguf):
    ours_config, ours_tokenizer = _ours(default_gguf)
    reference_config, reference_tokenizer = _from_file(default_gguf)
    _assert_same_config(ours_config, reference_config)
    _assert_same_tokenizer(ours_tokenizer, reference_tokenizer)


def test_tokenizer_metadata_equals_transformers_reader(default_gguf):
    """The fields handed to transformers' converter are the ones its own reader would hand it."""
    tokenizer_mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    _, tokenizer_dict, init_kwargs = tokenizer_mapping.get_gguf_tokenizer(default_gguf)
    reader = gguf_file._reader(default_gguf)
    ours = gguf_file._tokenizer_values(reader, tokenizer_mapping.GGUF_TOKENIZER_MAPPING)
    assert ours == (tokenizer_dict, init_kwargs)


# Keys transformers' GGUF mapping drops and we read on top: Mistral's sliding window, Qwen3's head
# size (transformers falls back to Qwen3Config's 128).
READ_ON_TOP = {"mistral": ("sliding_window",), "qwen3": ("head_dim",)}


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_tiny_gguf_config_and_tokenizer_equal_transformers_reading(tmp_path, tiny_models, tokenizer_dir, arch):
    """A Qwen3 file gets Qwen2Tokenizer (as a Qwen2 file does: Qwen3's config is Qwen2's and a
    head size); what transformers drops is read from the file."""
    from transformers import AutoConfig

    path = str(tmp_path / "model.gguf")  # alone in its folder: no tokenizer files beside it
    write_gguf(tiny_models[arch], path, "F32", tokenizer_dir)
    ours_config, ours_tokenizer = _ours(path)
    reference_config, reference_tokenizer = _from_file(path)
    _assert_same_config(ours_config, reference_config, ignore=READ_ON_TOP.get(arch, ()))
    original = AutoConfig.from_pretrained(tiny_models[arch])
    if arch == "mistral":
        assert ours_config.sliding_window == original.sliding_window == 8
    assert head_dim(ours_config) == head_dim(original)
    if arch != "mistral":  # the layers' windows and shapes equal those of the checkpoint the file came from
        for flags in ((False, False), (True, False), (False, True)):
            ours, theirs = DecoderConfig.of(ours_config, *flags), DecoderConfig.of(original, *flags)
            assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # a float32 in the file
            assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    _assert_same_tokenizer(ours_tokenizer, reference_tokenizer)


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    def wrap(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


def test_file_is_parsed_once_for_config_tokenizer_and_weights(monkeypatch, default_gguf):
    import gguf

    gguf_reader, hf_reader = _Counter(), _Counter()
    monkeypatch.setattr(gguf.GGUFReader, "__init__", gguf_reader.wrap(gguf.GGUFReader.__init__))
    try:  # transformers 5's own metadata reader, behind AutoConfig/AutoTokenizer(gguf_file=...)
        from transformers.integrations.gguf import reader as transformers_reader

        monkeypatch.setattr(transformers_reader, "_mapped", hf_reader.wrap(transformers_reader._mapped))
    except ImportError:
        pass
    gguf_file._reader.cache_clear()
    try:
        model_config = load_model_config(None, "float32", None, "cpu")
        load_tokenizer(model_config)
        assert gguf_file.num_tensors(default_gguf) > 0
        name, weight = next(gguf_file.iter_gguf_weights(default_gguf, model_config.hf_config))
        assert name and weight.numel() > 0
    finally:
        gguf_file._reader.cache_clear()  # the cached reader was made under the patch
    assert (gguf_reader.calls, hf_reader.calls) == (1, 0)
