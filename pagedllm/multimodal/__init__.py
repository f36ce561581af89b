"""Images in prompts. This package's top level is torch-free: the core imports it to schedule the
encoder and to hash images into block hashes; the processors and encoders live beside it."""

from pagedllm.multimodal.inputs import MultiModalFeature, content_identifier

__all__ = ["MultiModalFeature", "content_identifier"]
