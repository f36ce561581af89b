"""EncoderCacheManager: the scheduler's books of the worker's encoder outputs (an image's
embeddings, one row a placeholder token), keyed by the image's content identifier.

An image is encoded once however many requests show it, while its entry lives: requests reference
the entries their prompts use until they have computed those tokens (or end, or are preempted).
An entry no request references stays cached, least recently released first in line to be evicted,
and only when a new entry needs its room; the worker learns of evictions with the next step
(`take_evicted`) and drops those tensors. Sizes count embedding rows. Pure Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.multimodal import MultiModalFeature


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_free = capacity  # rows no entry takes (freeable entries still take theirs)
        self.sizes: dict[int, int] = {}  # identifier -> rows, for every cached entry
        self.refs: dict[int, set[str]] = {}  # identifier -> the requests referencing it (non-empty)
        self.freeable: OrderedDict[int, None] = OrderedDict()  # unreferenced entries, oldest first
        self._evicted: list[int] = []
        self.num_hits = 0  # a request found its image encoded
        self.num_encoded = 0  # images sent to the encoder
        self.num_encoded_rows = 0

    def lookup(self, request_id: str, feature: MultiModalFeature) -> bool:
        """True if the image is cached: the request now references it."""
        key = feature.identifier
        if key not in self.sizes:
            return False
        if request_id not in self.refs.get(key, ()):
            self.num_hits += 1
            self._reference(request_id, key)
        return True

    def can_allocate(self, feature: MultiModalFeature) -> bool:
        """Room for the image, counting the freeable entries that would be evicted for it."""
        return feature.length <= self.num_free + sum(self.sizes[k] for k in self.freeable)

    def allocate(self, request_id: str, feature: MultiModalFeature) -> None:
        """Book the image's rows for the request (its encoder runs this step), evicting the least
        recently released unreferenced entries for room."""
        while self.num_free < feature.length:
            key, _ = self.freeable.popitem(last=False)  # KeyError: allocate without can_allocate
            self.num_free += self.sizes.pop(key)
            self._evicted.append(key)
        self.num_free -= feature.length
        self.sizes[feature.identifier] = feature.length
        self.num_encoded += 1
        self.num_encoded_rows += feature.length
        self._reference(request_id, feature.identifier)

    def release(self, request_id: str, feature: MultiModalFeature) -> None:
        """The request no longer needs the image; once none does, the entry is freeable."""
        holders = self.refs.get(feature.identifier)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders:
            del self.refs[feature.identifier]
            self.freeable[feature.identifier] = None

    def cancel(self, feature: MultiModalFeature) -> None:
        """Undo an allocate whose step was not sent (its request was preempted or left waiting in
        the same schedule): the entry was never encoded, so it goes, whoever references it."""
        size = self.sizes.pop(feature.identifier, None)
        if size is None:
            return
        self.num_free += size
        self.refs.pop(feature.identifier, None)
        self.freeable.pop(feature.identifier, None)
        self.num_encoded -= 1
        self.num_encoded_rows -= size

    def take_evicted(self) -> list[int]:
        evicted, self._evicted = self._evicted, []
        return evicted

    @property
    def num_cached_rows(self) -> int:
        return self.capacity - self.num_free

    def _reference(self, request_id: str, key: int) -> None:
        self.refs.setdefault(key, set()).add(request_id)
        self.freeable.pop(key, None)
