"""The model's tokenizer: loaded once, then a copy of its own for each thread that uses it.

The engine's frontend encodes on the event loop and in the tokenize pool, and decodes on the
engine thread. A Hugging Face fast tokenizer is one Rust object behind a borrow flag: a call that
changes its settings (truncation, padding) while another thread encodes makes either come out
wrong or raise "Already borrowed". So no thread shares one: `PerThreadTokenizer.get()` gives the
calling thread its own copy, made on its first call from the loaded one, which is kept pickled: a
live tokenizer that no thread uses would take as much memory as a copy (27 MiB for a 49k-token GGUF
vocabulary, against about 1 MB pickled).
"""

from __future__ import annotations

import logging
import pickle
import threading
from typing import TYPE_CHECKING

from pagedllm.config import text_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagedllm.config import ModelConfig

logger = logging.getLogger(__name__)


def load_tokenizer(model_config: ModelConfig, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer (or the named one). One without a chat template takes its family's
    default where the family has one (Gemma's turn format: its GGUF files may carry none)."""
    from transformers import AutoTokenizer

    from pagedllm.models.registry import model_class

    if tokenizer is not None:
        loaded = AutoTokenizer.from_pretrained(tokenizer)
    elif model_config.is_gguf:
        from pagedllm.models.gguf import load_gguf_tokenizer

        loaded = load_gguf_tokenizer(model_config.path, text_config(model_config.hf_config))
    else:
        loaded = AutoTokenizer.from_pretrained(model_config.path)
    family = model_class(model_config.hf_config)
    fallback = getattr(family, "default_chat_template", None)
    if not getattr(loaded, "chat_template", None) and fallback:
        logger.info("The tokenizer has no chat template: using %s's default", family.__name__)
        loaded.chat_template = fallback
    return loaded


class PerThreadTokenizer:
    """One tokenizer, a copy for each thread (see the module's docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._pickled = pickle.dumps(tokenizer)  # only ever copied
        self._local = threading.local()

    def get(self) -> PreTrainedTokenizerBase:
        """The calling thread's own copy."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:  # (immutable bytes: no lock needed to copy from them)
            tokenizer = self._local.tokenizer = pickle.loads(self._pickled)
        return tokenizer
