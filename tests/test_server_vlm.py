"""Images through the OpenAI-compatible server, with the official openai client: base64 data URLs,
file: paths under --allowed-local-media-path, http URLs (a server on 127.0.0.1), several images a
message; held to transformers on the same tiny LLaVA. Each bad image is a 400 naming the field,
and the server goes on."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import socket
import threading

import httpx
import pytest

from server_utils import Server
from vlm_utils import CHAT_TEMPLATE, MAX_TOKENS, hf_greedy, load_hf_llava, picture

openai = pytest.importorskip("openai")


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder of images, also served over http on 127.0.0.1."""
    root = tmp_path_factory.mktemp("media")
    (root / "two.png").write_bytes(png(picture(2)))
    (root / "huge.png").write_bytes(png(picture(0, (1, 1)).convert("1").resize((8300, 8300))))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    banner = socket.create_server(("127.0.0.1", 0))  # answers like an SSH server, not http

    def answer() -> None:
        while True:
            connection, _ = banner.accept()
            connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            connection.close()

    threading.Thread(target=answer, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}", f"http://127.0.0.1:{banner.getsockname()[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(llava_dir, media, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    root = media[0]
    s = Server(
        llava_dir,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--chat-template",
        str(template),
        "--allowed-local-media-path",
        str(root),
        "--limit-mm-per-prompt",
        '{"image": 3}',
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _image(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def _chat(client, content: list[dict]):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        logprobs=True,
    )


def test_images_by_data_file_and_http_urls_equal_transformers(client, llava_dir, media):
    root, base, _ = media
    content = [
        _image(data_url(png(picture(1))), "low"),
        {"type": "text", "text": "Which differs,"},
        _image(f"file://{root}/two.png"),
        {"type": "text", "text": " or"},
        _image(f"{base}/two.png", "high"),
        {"type": "text", "text": "?"},
    ]
    response = _chat(client, content)
    text = "USER: <image>Which differs,<image> or<image>?\nASSISTANT:"
    hf = load_hf_llava(llava_dir)
    expected = hf_greedy(hf, text, [picture(1), picture(2), picture(2)], add_special_tokens=False)[0]
    assert response.choices[0].message.content == hf[1].tokenizer.decode(expected, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(
        hf[1](text=text, images=[picture(1)] * 3, add_special_tokens=False)["input_ids"][0]
    )


BAD = [
    ("undecodable base64", [_image("data:image/png;base64,@@@not base64@@@")], "base64"),
    ("not an image", [_image(data_url(b"just some text, no picture"))], "cannot be decoded"),
    ("not a data URL of an image", [_image("data:text/plain;base64,aGk=")], "data:image/"),
    ("too many pixels", [_image("file://{root}/huge.png")], "pixels"),
    ("too many images", [_image(data_url(png(picture(1))))] * 4, "limit-mm-per-prompt allows 3"),
    ("outside the allowed path", [_image("file:///etc/hostname")], "outside --allowed-local-media-path"),
    ("an http URL that is not there", [_image("{base}/missing.png")], "cannot fetch"),
    ("an unknown scheme", [_image("ftp://example.com/x.png")], "data:, file: or http"),
    ("a server that does not speak http", [_image("{not_http}/x.png")], "cannot fetch"),
    ("a thin strip", [_image(data_url(png(picture(0, (1, 300)))))], "more than 200 to 1"),
    ("no placeholder's worth of text", [{"type": "text", "text": "hi"}, {"type": "image_url"}], None),
]


@pytest.mark.parametrize("name, content, message", BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_400s_naming_messages_and_the_server_goes_on(server, media, name, content, message):
    root, base, not_http = media
    content = [
        {**part, "image_url": {"url": part["image_url"]["url"].format(root=root, base=base, not_http=not_http)}}
        if part.get("image_url")
        else part
        for part in content
    ]
    body = {"model": "any", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    body["model"] = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" or error["param"].startswith("messages"), error
    if message is not None:
        assert message in error["message"], error
    ok = {**body, "messages": [{"role": "user", "content": [_image(data_url(png(picture(3))))]}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=ok, timeout=60).status_code == 200


def test_the_dashboard_and_metrics_show_the_encoder_cache(server, client):
    _chat(client, [_image(data_url(png(picture(4))))])
    # The same picture after other text: no cached blocks hold it, the encoder cache does.
    _chat(client, [{"type": "text", "text": "Look:"}, _image(data_url(png(picture(4))))])
    state = httpx.get(f"{server.url}/dashboard/state", timeout=30).json()
    stats = state["replicas"][0]["stats"]
    assert stats["encoder_cache_entries"] >= 1 and stats["encoder_cache_hits"] >= 1
    assert stats["encoder_cache_used"] == 4 * stats["encoder_cache_entries"] and stats["encoder_cache_size"] == 32
    assert state["embedding_bytes"] == 64 * 4  # the language model's width, fp32
    assert 'id="encoder-card"' in httpx.get(f"{server.url}/dashboard").text
    metrics = httpx.get(f"{server.url}/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("pagedllm:encoder_cache_hits_total{")]
    assert len(hits) == 1 and float(hits[0].split()[-1]) == stats["encoder_cache_hits"]


def _encoded_image(draw) -> str:
    """A data URL of random bytes, of a truncated image, or of a real image of a random mode, size
    and format."""
    from hypothesis import strategies as st
    from PIL import Image

    kind = draw(st.sampled_from(["image", "image", "truncated", "bytes"]))
    if kind == "bytes":
        return data_url(draw(st.binary(max_size=64)), draw(st.sampled_from(["png", "jpeg", "webp"])))
    mode = draw(st.sampled_from(["RGB", "RGBA", "L", "1", "P", "I", "F", "CMYK"]))
    size = (draw(st.integers(1, 80)), draw(st.integers(1, 80)))
    fmt = draw(
        st.sampled_from(["PNG", "TIFF", "GIF", "BMP"] if mode in ("I", "F") else ["PNG", "JPEG", "GIF", "BMP", "TIFF"])
    )
    image = Image.new(mode, size, color=draw(st.integers(0, 255)))
    buffer = io.BytesIO()
    try:
        image.save(buffer, format=fmt)
    except (OSError, ValueError, KeyError):
        buffer = io.BytesIO(png(picture(0)))
    data = buffer.getvalue()
    return data_url(data[: len(data) // 2] if kind == "truncated" else data)


def test_random_images_and_parts_get_200_or_a_400_and_the_server_goes_on(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    part = st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=12)),
        st.composite(lambda draw: _image(_encoded_image(draw), draw(st.sampled_from([None, "low", "auto"]))))(),
    )
    statuses: list[int] = []

    @given(content=st.lists(part, max_size=5))
    @settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def check(content: list[dict]) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        statuses.append(response.status_code)
        assert response.status_code in (200, 400), response.text[:300]
        if response.status_code == 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert statuses.count(200) >= 5 and statuses.count(400) >= 5, statuses
    assert server.process.poll() is None
