"""MultiModalFeature: one image of a prompt, as the engine carries it from the frontend to the
encoder. Its placeholder tokens are already in the prompt's token ids (the processor expanded
them); the feature says where they sit, what the encoder is fed, and a content hash."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


def content_identifier(*parts: bytes) -> int:
    """A 63-bit int of blake2b over the parts. Not Python's hash(): a str's is salted per process,
    and block hashes made from it must agree between the data-parallel router and the replicas."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    modality: str  # "image"
    identifier: int  # content_identifier of what the encoder is fed: equal inputs, equal outputs
    offset: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens, each of which takes one row of the encoder's output
    # The encoder's inputs (a processor's arrays: pixel values, grid sizes), for the worker only.
    data: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end
