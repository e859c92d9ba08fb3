"""Image skills through every interface (issue 62, items 5 and 6): `LLM.query/caption`, `AsyncLLM.query/caption`, gRPC
(`GenerateRequest.image/skill/length`, the engine in a child process, the image decoded in the frontend) and `jphoton
query|caption`. Bad images are refused at submission with one line (nothing queued, no KV page held, the engine keeps
serving); the documented conversions (jphoton/image/decode.py) reach the engine: a converted file and the RGB array it
stands for are one image to the engine (the prefix cache keys an image's pages on its pixels' digest, so the second
request hits the first one's pages). A text model asked for a skill says so. Decoding itself: tests/test_image_input.py.

One tiny random Moondream checkpoint (write_random_checkpoint: 1 text and 1 vision layer, 140-pixel crops, so a
101-position image prefix) serves the module, in this process and in the gRPC server's engine process.
"""

from __future__ import annotations

import asyncio
import functools
import io
import struct
import threading
import time
import zlib

import grpc
import numpy as np
import pytest
from PIL import Image

from jphoton import LLM, AsyncLLM, SamplingParams
from jphoton.image import skills
from jphoton.models.moondream import MoondreamConfig, RegionConfig, TextConfig, VisionConfig
from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import serve
from jphoton.server.engine_process import Spawn
from jphoton.weights.moondream import write_random_checkpoint

from conftest import FIXTURES, shared_llm

TINY = MoondreamConfig(
    text=TextConfig(dim=64, ff_dim=128, n_layers=1, n_heads=1),
    vision=VisionConfig(enc_dim=72, ff_dim=144, n_layers=1, n_heads=1, crop_size=140, proj_inner_dim=128),
    region=RegionConfig(coord_feat_dim=16, coord_out_dim=32, size_feat_dim=16, size_out_dim=32, inner_dim=32))
MAX_PIXELS, MAX_BYTES = 2**17, 2**16
# one prefill bucket that holds the image prefix and its template, two decode buckets: few compiles
ENGINE = dict(dtype="float32", freeze_gc=False, warmup="off", max_num_seqs=8, max_num_batched_tokens=128,
              decode_buckets=(1, 8), prefill_buckets=((1, 128),), max_image_pixels=MAX_PIXELS,
              max_image_bytes=MAX_BYTES)
GREEDY = SamplingParams(max_tokens=3, temperature=0)
FAST_S = 2.0  # a refusal's bound (one line at submission; generous for a loaded 2-core box)
RNG = np.random.default_rng(0)
PICTURE = RNG.integers(0, 256, (24, 32, 3), dtype=np.uint8)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


PNG_BYTES = _encode(Image.fromarray(PICTURE), "PNG")


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over 1x1 pixels of data: refused from the header or not at all."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\x00\x00\x00"))
            + chunk(b"IEND", b""))


def bad_images() -> dict[str, tuple[object, str]]:
    """name -> (image, what its one-line refusal says)."""
    png = PNG_BYTES
    corrupt = bytearray(png)
    corrupt[png.index(b"IDAT") + 12] ^= 0xFF  # a flipped byte in the pixel data (its CRC no longer matches)
    noise = RNG.integers(0, 256, (160, 160, 3), dtype=np.uint8)  # ~77 KB as PNG: over MAX_BYTES
    return {
        "not an image": (b"Hello, world! This is not an image at all.", "not a JPEG, PNG, WebP or GIF"),
        "truncated": (png[: len(png) // 2], "truncated"),
        "corrupt": (bytes(corrupt), "cannot decode PNG"),
        "bomb": (_png_claiming(20_000, 20_000), f"more than max_image_pixels={MAX_PIXELS}"),
        "over the pixel limit": (_png_claiming(400, 400), f"160000 pixels, more than max_image_pixels={MAX_PIXELS}"),
        "over the byte limit": (_encode(Image.fromarray(noise), "PNG"), f"more than max_image_bytes={MAX_BYTES}"),
        "empty bytes": (b"", "empty"),
        "zero-size array": (np.zeros((0, 4, 3), np.uint8), "empty"),
        "a path": ("/etc/passwd", "path"),
    }


def converted_images() -> dict[str, tuple[bytes, np.ndarray]]:
    """name -> (an encoded file that decode.py converts, the HxWx3 uint8 RGB array it documents it becomes). Each
    case's pixels are its own (a wrong conversion must not land on an image some other request sent)."""
    out = {}
    v16 = (np.arange(24 * 32, dtype=np.uint32).reshape(24, 32) * 85).astype(np.uint16)
    gray = np.round(v16 / 257).astype(np.uint8)  # round(v * 255 / 65535)
    out["16-bit"] = (_encode(Image.fromarray(v16), "PNG"), np.repeat(gray[:, :, None], 3, axis=2))
    cmyk = _encode(Image.fromarray(RNG.integers(0, 256, (24, 32, 3), dtype=np.uint8)).convert("CMYK"), "JPEG")
    with Image.open(io.BytesIO(cmyk)) as img:
        assert img.mode == "CMYK"
        out["CMYK"] = (cmyk, np.array(img.convert("RGB")))  # the reference's convert("RGB")
    palette = np.array([[250, 10, 10], [10, 240, 20], [30, 30, 200]], np.uint8)
    index = RNG.integers(0, 3, (24, 32), dtype=np.uint8)
    p = Image.fromarray(index, "P")
    p.putpalette(palette.ravel().tolist())
    out["palette"] = (_encode(p, "PNG"), palette[index])
    rgba = RNG.integers(0, 256, (24, 32, 4), dtype=np.uint8)
    on_black = (rgba[:, :, :3].astype(np.uint16) * rgba[:, :, 3:] + 127) // 255
    out["alpha"] = (_encode(Image.fromarray(rgba, "RGBA"), "PNG"), on_black.astype(np.uint8))
    frames = [Image.fromarray(index, "P") for _ in range(3)]
    for k, f in enumerate(frames):
        f.putpalette(np.roll(palette, k, axis=0).ravel().tolist())
    out["animated"] = (_encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50), palette[index])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    turned = RNG.integers(0, 256, (20, 36, 3), dtype=np.uint8)
    out["EXIF-rotated"] = (_encode(Image.fromarray(turned), "PNG", exif=exif.tobytes()), np.rot90(turned, k=-1))
    return out


def _check_refusal(message: str, name: str, says: str, seconds: float) -> None:
    assert says in message and "\n" not in message and len(message) < 200, (name, message)
    assert seconds < FAST_S, (name, seconds)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("moondream_tiny")
    write_random_checkpoint(d, TINY, seed=0)
    return str(d)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with shared_llm(checkpoint, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def text_llm():
    """A model without an image encoder (compiles nothing: every call here is refused at submission)."""
    with shared_llm(FIXTURES / "tiny" / "llama3", warmup="off") as llm:
        yield llm


@pytest.fixture(scope="module")
def served(checkpoint):
    """The server as `jphoton serve` runs it: the engine (the same engine options) in a child process."""
    handle = serve(Spawn(functools.partial(LLM, checkpoint, **ENGINE)), port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, pb_grpc.EngineStub(channel)
    channel.close()
    handle.stop(grace=5)


@pytest.fixture
def decode_threads(monkeypatch):
    """The names of the threads that decode images from now on (skills.prepare's load_image)."""
    names = []
    real = skills.load_image

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(skills, "load_image", spy)
    return names


def _idle(llm) -> None:
    assert not llm.engine.sequences and not llm.has_unfinished_requests()
    s = llm.stats()
    assert s["running"] == s["waiting"] == 0 and s["kv_pages_free"] + s["kv_pages_evictable"] == s["kv_pages_total"]


# ---- LLM ------------------------------------------------------------------------------------------------------------
def test_llm_refuses_bad_images_at_submission_and_keeps_serving(llm):
    for name, (image, says) in bad_images().items():
        for skill, text in (("query", "w17"), ("caption", "short")):
            t0 = time.perf_counter()
            with pytest.raises(ValueError) as e:
                getattr(llm, skill)(image, text, GREEDY)
            _check_refusal(str(e.value), name, says, time.perf_counter() - t0)
            _idle(llm)
    with pytest.raises(ValueError, match="caption: length must be one of short, normal, long"):
        llm.caption(PICTURE, "huge")
    out = llm.query(PICTURE, "w17", GREEDY)
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def _hits(stats: dict) -> int:
    return stats["prefix_hit_tokens"]


def test_llm_applies_the_documented_conversions(llm):
    for name, (data, expected) in converted_images().items():
        llm.reset_prefix_cache()
        llm.query(expected, "w5", SamplingParams(max_tokens=1, temperature=0))
        before = _hits(llm.stats())
        llm.query(data, "w5", SamplingParams(max_tokens=1, temperature=0))  # the same image: its pages are reused
        assert _hits(llm.stats()) - before >= TINY.prefix_len // 16 * 16, name


def test_a_text_model_refuses_skills(text_llm):
    for ask in (lambda: text_llm.query(PICTURE, "What is this?"), lambda: text_llm.query(None, "What is this?"),
                lambda: text_llm.caption(PICTURE)):
        with pytest.raises(ValueError, match="takes no images"):
            ask()

    async def run():
        engine = AsyncLLM(text_llm)
        try:
            with pytest.raises(ValueError, match="takes no images"):
                [out async for out in engine.query(PICTURE, "What is this?")]
        finally:
            engine.shutdown()
    asyncio.run(run())


# ---- AsyncLLM -------------------------------------------------------------------------------------------------------
def test_async_llm_refuses_bad_images_and_streams_good_ones(llm, decode_threads):
    png = _encode(Image.fromarray(PICTURE), "PNG")
    want_query = llm.query(png, "w17", GREEDY).token_ids
    want_caption = llm.caption(png, "short", GREEDY).token_ids
    want_text_only = llm.query(None, "w17", GREEDY).token_ids
    decode_threads.clear()

    async def run():
        engine = AsyncLLM(llm)
        try:
            for name, (image, says) in bad_images().items():
                t0 = time.perf_counter()
                with pytest.raises(ValueError) as e:
                    [out async for out in engine.query(image, "w17", GREEDY)]
                _check_refusal(str(e.value), name, says, time.perf_counter() - t0)
            with pytest.raises(ValueError, match="caption: length must be one of"):
                [out async for out in engine.caption(png, "huge", GREEDY)]
            # concurrent streams, each its own answer; a stream left early is aborted
            answers = await asyncio.gather(_tokens(engine.query(png, "w17", GREEDY)),
                                           _tokens(engine.caption(png, "short", GREEDY)),
                                           _tokens(engine.query(None, "w17", GREEDY)))
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            async for out in engine.query(png, "w17", long):
                assert out.delta.token_ids and out.delta.finish_reason is None
                break
            data, expected = converted_images()["EXIF-rotated"]
            llm.reset_prefix_cache()
            await _tokens(engine.query(expected, "w6", GREEDY))
            before = _hits(llm.stats())
            await _tokens(engine.query(data, "w6", GREEDY))
            return answers, _hits(llm.stats()) - before
        finally:
            engine.shutdown()

    answers, hits = asyncio.run(run())
    assert answers == [want_query, want_caption, want_text_only]
    assert hits >= TINY.prefix_len // 16 * 16  # the EXIF-rotated file became the rotated array
    _idle(llm)
    assert decode_threads and all(n.startswith("jphoton-prepare") for n in decode_threads), decode_threads


async def _tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.delta.token_ids]


# ---- gRPC -----------------------------------------------------------------------------------------------------------
def _request(image=b"", text="w17", skill="query", **kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", pb.SamplingParams(max_tokens=3, temperature=0))
    return pb.GenerateRequest(image=image, text=text, skill=skill, sampling=sampling, **kw)


def _refused(stub, request) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=30))
    return e.value.code(), e.value.details(), time.perf_counter() - t0


def _wait_idle(stub, timeout: float = 30.0) -> pb.Stats:
    deadline = time.monotonic() + timeout
    while True:
        s = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        if s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and not (s.running or s.waiting or s.queued):
            return s
        assert time.monotonic() < deadline, f"pages/requests not released: {s}"
        time.sleep(0.02)


def test_grpc_refuses_bad_images_and_misused_fields_invalid_argument(served, llm, decode_threads):
    _, stub = served
    # (empty image bytes are no image, as proto3 has it: a text-only query)
    cases = {name: (image, says) for name, (image, says) in bad_images().items() if isinstance(image, bytes) and image}
    misuse = {
        "image without skill": (_request(PNG_BYTES, skill=""), "needs skill 'query', 'caption', 'point' or 'detect'"),
        "length without skill": (pb.GenerateRequest(text="w1", length="short"), "needs skill 'query', 'caption'"),
        "unknown skill": (_request(PNG_BYTES, skill="segment"), "skill must be 'query', 'caption', 'point' or"),
        "point with sampling": (_request(PNG_BYTES, skill="point"), "sampling and lora do not apply"),
        "detect without image": (pb.GenerateRequest(text="w1", skill="detect"), "needs an image"),
        "point without object": (pb.GenerateRequest(image=PNG_BYTES, text=" ", skill="point"), "object (text) is empty"),
        "detect with length": (pb.GenerateRequest(image=PNG_BYTES, text="w1", skill="detect", length="short"),
                               "length is for skill 'caption'"),
        "query with max_objects": (_request(PNG_BYTES, max_objects=3), "max_objects is for skills"),
        "huge max_objects": (pb.GenerateRequest(image=PNG_BYTES, text="w1", skill="point", max_objects=10**6),
                             "max_objects must be an integer in [1, 1000]"),
        "token_ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), image=PNG_BYTES, skill="query"),
                      "token_ids and chat do not apply"),
        "chat": (_request(PNG_BYTES, chat=True), "token_ids and chat do not apply"),
        "caption with text": (_request(PNG_BYTES, skill="caption"), "takes no text"),
        "query with length": (_request(PNG_BYTES, length="short"), "length is for skill 'caption'"),
        "empty question": (_request(PNG_BYTES, text=" "), "the question (text) is empty"),
        "caption without image": (_request(text="", skill="caption"), "caption: an image is required"),
        "bad length": (_request(PNG_BYTES, text="", skill="caption", length="huge"), "length must be one of"),
        **{name: (_request(image), says) for name, (image, says) in cases.items()},
        "over max_image_bytes, as caption": (_request(cases["over the byte limit"][0], text="", skill="caption"),
                                             f"more than max_image_bytes={MAX_BYTES}"),
    }
    for name, (request, says) in misuse.items():
        code, details, seconds = _refused(stub, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        _check_refusal(details, name, says, seconds)
    _wait_idle(stub)
    # the engine process never saw an image: every decode ran on the frontend's image threads (this process)
    assert decode_threads and all(n.startswith("jphoton-image") for n in decode_threads), decode_threads
    # and it keeps serving: the answers LLM.query gives
    got = [t for m in stub.Generate(_request(PNG_BYTES), timeout=60) for t in m.token_ids]
    assert got == llm.query(PNG_BYTES, "w17", GREEDY).token_ids
    msgs = list(stub.Generate(_request(PNG_BYTES, text="", skill="caption", length="short"), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == llm.caption(PNG_BYTES, "short", GREEDY).token_ids
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.prompt_tokens > TINY.prefix_len
    msgs = list(stub.Generate(_request(b"", text="w17"), timeout=60))  # no image: a text-only query
    assert [t for m in msgs for t in m.token_ids] == llm.query(None, "w17", GREEDY).token_ids
    assert msgs[-1].usage.prompt_tokens < TINY.prefix_len


def test_point_and_detect_over_grpc_async_and_llm_agree(served, llm):
    """The same points and boxes from LLM.point / detect, AsyncLLM and gRPC (the last message's points / boxes; no
    message carries token ids), at most max_objects; the pages come back."""
    _, stub = served
    want = {skill: getattr(llm, skill)(PNG_BYTES, "w17", max_objects=3) for skill in ("point", "detect")}
    assert 0 < len(want["point"]) <= 3 and all(len(p) == 2 for p in want["point"])
    assert all(len(b) == 4 and b[0] <= b[2] and b[1] <= b[3] for b in want["detect"])
    for skill, found in want.items():
        msgs = list(stub.Generate(pb.GenerateRequest(image=PNG_BYTES, text="w17", skill=skill, max_objects=3),
                                  timeout=60))
        assert not any(m.token_ids for m in msgs) and msgs[-1].finish_reason in ("stop", "length")
        got = ([(p.x, p.y) for p in msgs[-1].points] if skill == "point" else
               [(b.x_min, b.y_min, b.x_max, b.y_max) for b in msgs[-1].boxes])
        np.testing.assert_allclose(np.asarray(got), np.asarray(found), rtol=0, atol=1e-6)  # (float32 on the wire)
    _wait_idle(stub)

    async def run():
        engine = AsyncLLM(llm)
        try:
            with pytest.raises(ValueError, match="non-empty"):
                await engine.point(PNG_BYTES, "", 3)
            return await asyncio.gather(engine.point(PNG_BYTES, "w17", 3), engine.detect(PNG_BYTES, "w17", 3))
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == [want["point"], want["detect"]]
    _idle(llm)
    for _ in range(5):  # shut down as the answer arrives, its zombie step still in flight: landed by the shutdown

        async def once():
            engine = AsyncLLM(llm)
            try:
                return await engine.point(PNG_BYTES, "w17", 3)
            finally:
                engine.shutdown()

        assert asyncio.run(once()) == want["point"]
        _idle(llm)


def test_grpc_applies_the_documented_conversions(served):
    _, stub = served
    for name, (data, expected) in converted_images().items():
        list(stub.Generate(_request(_encode(Image.fromarray(expected), "PNG"), text="w7"), timeout=60))
        before = _wait_idle(stub).prefix_hit_tokens
        list(stub.Generate(_request(data, text="w7"), timeout=60))
        assert _wait_idle(stub).prefix_hit_tokens - before >= TINY.prefix_len // 16 * 16, name


def test_grpc_cancel_and_abort_free_the_pages(served):
    _, stub = served
    long = pb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    call = stub.Generate(_request(PNG_BYTES, sampling=long), timeout=60)
    first = next(call)
    assert first.token_ids and first.request_id
    call.cancel()
    _wait_idle(stub)
    call = stub.Generate(_request(PNG_BYTES, sampling=long, request_id="vision-abort"), timeout=60)
    assert next(call).token_ids
    assert stub.Abort(pb.AbortRequest(request_id="vision-abort"), timeout=10).found
    assert [m.finish_reason for m in call][-1] == "abort"
    _wait_idle(stub)


def test_grpc_with_a_text_model_refuses_skills(text_llm):
    handle = serve(text_llm, port=0)
    try:
        stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{handle.port}"))
        for request in (_request(PNG_BYTES), _request(skill="query"), _request(text="", skill="caption")):
            code, details, _ = _refused(stub, request)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "takes no images" in details, details
        _wait_idle(stub)
    finally:
        handle.stop(grace=1)


# ---- CLI ------------------------------------------------------------------------------------------------------------
def test_cli_point_and_detect(llm, checkpoint, tmp_path, capsys, monkeypatch):
    from jphoton import cli

    image = tmp_path / "picture.png"
    image.write_bytes(PNG_BYTES)
    built = []
    monkeypatch.setattr(cli, "build_llm", lambda *args, **kwargs: built.append(args) or llm)
    for argv in (["point", str(tmp_path / "missing.png"), "w1"], ["detect", str(image), " "],
                 ["point", str(image), "w1", "--max-objects", "0"]):
        assert cli.main([*argv, "--model", checkpoint]) == 2
        assert capsys.readouterr().err.startswith("jphoton: error: ")
    assert not built
    for skill in ("point", "detect"):
        assert cli.main([skill, str(image), "w17", "--model", checkpoint, "--max-objects", "2"]) == 0
        lines = capsys.readouterr().out.split("\n")[:-1]
        want = getattr(llm, skill)(PNG_BYTES, "w17", max_objects=2)
        assert [tuple(float(v) for v in line.split()) for line in lines] == [
            tuple(round(v, 4) for v in o) for o in want]


def test_cli_query_and_caption(llm, checkpoint, tmp_path, capsys, monkeypatch):
    from jphoton import cli

    image = tmp_path / "picture.png"
    image.write_bytes(PNG_BYTES)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    built = []
    monkeypatch.setattr(cli, "build_llm", lambda *args, **kwargs: built.append(args) or llm)  # (the module's engine)
    for argv in (["query", str(tmp_path / "missing.png"), "w1"], ["caption", str(tmp_path / "bad.png")]):
        assert cli.main([*argv, "--model", checkpoint]) == 2
        assert capsys.readouterr().err.startswith("jphoton: error: ")
    assert not built  # refused before the model loaded
    assert cli.main(["query", str(image), "w17", "--model", checkpoint, "--temperature", "0", "--max-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == [f"w{t}" for t in llm.query(PICTURE, "w17", GREEDY).token_ids]
    assert "finish_reason=length" in out.err and built == [(checkpoint,)]
    argv = ["caption", str(image), "--length", "short", "--model", checkpoint, "--temperature", "0", "--max-tokens", "3"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.split() == [f"w{t}" for t in llm.caption(PICTURE, "short", GREEDY).token_ids]
