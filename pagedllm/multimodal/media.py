"""Images named by URL, as OpenAI's image_url parts name them: `data:image/...;base64,...`,
`file://` paths (only under --allowed-local-media-path, as vLLM's flag), and http(s) URLs fetched
with a size cap and a timeout. Every failure is a ValueError that says what was wrong."""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from time import monotonic

MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 64 * 2**20  # about 8k x 8k; Pillow's own bomb check would warn, not refuse
MAX_ASPECT_RATIO = 200  # a 1 x 60M strip passes the pixel cap, and a processor resizing it would not
FETCH_TIMEOUT_S = 10.0  # the whole download's, not each read's


def load_image_url(url: str, allowed_local_media_path: str | None = None):
    """The RGB PIL image the URL names."""
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url needs a url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url))
    if scheme == "file":
        return decode_image(_local_file_bytes(url, allowed_local_media_path))
    if scheme in ("http", "https"):
        return decode_image(_fetch(url))
    raise ValueError(f"an image url is a data:, file: or http(s): URL, got {url[:40]!r}")


def decode_image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(data)} bytes; at most {MAX_IMAGE_BYTES} are taken")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(f"the image has {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} are taken")
        if max(width, height) > MAX_ASPECT_RATIO * max(min(width, height), 1):
            raise ValueError(f"the image is {width}x{height}: sides more than {MAX_ASPECT_RATIO} to 1 are refused")
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"the image cannot be decoded: {exc}") from exc


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise ValueError("a data URL image is data:image/<format>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data URL's base64 is not valid: {exc}") from exc


def _local_file_bytes(url: str, allowed: str | None) -> bytes:
    if not allowed:
        raise ValueError("file: image URLs are refused: the server was not started with --allowed-local-media-path")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"a file: URL names a local path, got host {parsed.netloc!r}")
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"{parsed.path} is outside --allowed-local-media-path")
    try:
        with open(path, "rb") as f:
            return f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {parsed.path}: {exc.strerror}") from exc


def _fetch(url: str) -> bytes:
    """At most MAX_IMAGE_BYTES + 1 bytes, read in pieces until FETCH_TIMEOUT_S has passed."""
    deadline = monotonic() + FETCH_TIMEOUT_S
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 (http(s) only)
            while len(data) <= MAX_IMAGE_BYTES:
                if monotonic() > deadline:
                    raise TimeoutError(f"not done in {FETCH_TIMEOUT_S:g} s")
                piece = response.read1(64 * 1024)
                if not piece:
                    break
                data += piece
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError, ValueError) as exc:
        raise ValueError(f"cannot fetch the image at {url[:80]}: {getattr(exc, 'reason', exc)}") from exc
    return bytes(data)
