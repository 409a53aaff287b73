"""Inference with images: `keel chat --image` and `keel serve` image_url parts on tiny
Qwen2-VL (M-RoPE) and LLaVA models equal transformers' own processor + generate; image
requests are refused with a 400 naming why; text requests beside them are unaffected."""

from __future__ import annotations

import base64
import io
import threading

import httpx
import pytest
import torch
from cli_support import keel_in_process
from serve_support import Paused, tiny_server_state
from vlm_support import (
    build_llava_image_processor,
    build_llava_tokenizer,
    build_qwen2_vl_image_processor,
    build_qwen2_vl_tokenizer,
    build_tiny_llava,
    build_tiny_qwen2_vl,
    make_image,
    write_image,
)

from keel.infer.generate import ChatImages, generate_reply
from keel.infer.serve.limits import ServeLimits
from keel.infer.serve.server import BackgroundServer, ServeOptions, build_state
from keel.infer.vision import encode_with_images, vision_of, with_images_first
from keel.models import load_for_inference

QUIET = dict(log=lambda message: None)
QUESTION = "What is in the picture?"


def _varied(model):
    # Larger random weights, so greedy replies vary from token to token and with the image
    # (at transformers' 0.02 init a tiny model repeats one token whatever it sees).
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return model


def _write(path, model, tokenizer, image_processor):
    _varied(model).save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def vlm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2_vl":
        tokenizer = build_qwen2_vl_tokenizer()
        folder = _write(
            root / "model",
            build_tiny_qwen2_vl(tokenizer),
            tokenizer,
            build_qwen2_vl_image_processor(),
        )
    else:
        tokenizer = build_llava_tokenizer()
        folder = _write(
            root / "model", build_tiny_llava(tokenizer), tokenizer, build_llava_image_processor()
        )
    model, tokenizer = load_for_inference(str(folder), None, cache_dir=root / "cache", **QUIET)
    return {"kind": request.param, "dir": folder, "model": model, "tokenizer": tokenizer}


def _hf_processor(kind: str, tokenizer, image_processor):
    """transformers' own processor, the reference for keel's placeholder expansion."""
    from transformers import LlavaProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if kind == "llava":
        processor = LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
        return processor, "<image>"

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        # Qwen2VLProcessor cannot be built without torchvision (its video processor);
        # ProcessorMixin reads the attributes from this __init__'s signature.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return processor, "<|vision_start|><|image_pad|><|vision_end|>"


def _reference(vlm, messages, images) -> dict:
    vision = vision_of(vlm["model"], **QUIET)
    processor, marker = _hf_processor(vlm["kind"], vlm["tokenizer"], vision.image_processor)
    text = vlm["tokenizer"].apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return processor(text=[text.replace("<image>", marker)], images=images, return_tensors="pt")


def _greedy(model, tokenizer, inputs, new_tokens: int = 8) -> str:
    out = model.generate(
        **inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=2
    )  # [1, T + new]
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_chat_with_images_equals_transformers_processor(vlm):
    model, tokenizer = vlm["model"], vlm["tokenizer"]
    images = [make_image(1), make_image(2, size=(60, 70))]
    messages = [{"role": "user", "content": f"Compare <image> with <image>. {QUESTION}"}]
    reference = _reference(vlm, messages, images)
    prompt = encode_with_images(tokenizer, messages, images, vision_of(model, **QUIET))
    assert prompt.input_ids == reference["input_ids"][0].tolist()
    ours = {"input_ids": torch.tensor([prompt.input_ids]), **prompt.inputs}
    with torch.no_grad():
        expected = model(**reference).logits[:, -1]  # [1, V]
        got = model(**ours).logits[:, -1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    answer = generate_reply(
        model,
        tokenizer,
        messages,
        images=ChatImages(tuple(images), vision_of(model, **QUIET)),
        max_new_tokens=8,
    )
    assert answer == _greedy(model, tokenizer, reference)
    assert len(answer) > 3


def test_different_images_give_different_answers(vlm):
    model, tokenizer = vlm["model"], vlm["tokenizer"]
    vision = vision_of(model, **QUIET)
    messages = [{"role": "user", "content": with_images_first(QUESTION, 1)}]

    def answer(image):
        images = ChatImages((image,), vision)
        return generate_reply(model, tokenizer, messages, images=images, max_new_tokens=8)

    assert answer(make_image(1)) != answer(make_image(5))


@pytest.mark.parametrize("vlm", ["qwen2_vl"], indirect=True)  # the CLI is family-blind
def test_keel_chat_image_cli(vlm, tmp_path):
    image = write_image(tmp_path / "cat.png", seed=3)
    expected = generate_reply(
        vlm["model"],
        vlm["tokenizer"],
        [{"role": "user", "content": "<image>" + QUESTION}],
        images=ChatImages((make_image(3),), vision_of(vlm["model"], **QUIET)),
        max_new_tokens=6,
    )
    args = ["chat", "--model", str(vlm["dir"]), "--prompt", QUESTION, "--max-new-tokens", "6"]
    done = keel_in_process(*args, "--image", str(image), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(expected + "\n")
    missing = keel_in_process(*args, "--image", "nope.png", cwd=tmp_path)
    assert missing.returncode == 2 and "nope.png" in missing.stderr
    counted = keel_in_process(*args[:4], "<image> and <image>?", "--image", str(image))
    assert counted.returncode == 2 and "2 <image> placeholder(s) but 1 image(s)" in counted.stderr


def test_keel_chat_image_on_a_text_model_exits_2(tmp_path, tiny_tokenizer):
    from serve_support import varied_tiny_model, write_model_dir

    folder = write_model_dir(varied_tiny_model(len(tiny_tokenizer)), tiny_tokenizer, tmp_path / "m")
    image = write_image(tmp_path / "cat.png")
    done = keel_in_process("chat", "--model", str(folder), "--prompt", "hi", "--image", str(image))
    assert done.returncode == 2
    assert str(folder) in done.stderr and "text model" in done.stderr
    assert "Traceback" not in done.stderr


# --- keel serve ---------------------------------------------------------------------------


def _data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_message(url: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """A served tiny Qwen2-VL (M-RoPE: the hard case for a batch) with an image root."""
    root = tmp_path_factory.mktemp("serve-vlm")
    tokenizer = build_qwen2_vl_tokenizer()
    folder = _write(
        root / "model", build_tiny_qwen2_vl(tokenizer), tokenizer, build_qwen2_vl_image_processor()
    )
    write_image(root / "images" / "inside.png", seed=4)
    limits = ServeLimits(
        max_images=2, max_image_bytes=40_000, max_image_pixels=150 * 150, max_tokens=64
    )
    options = ServeOptions(model=str(folder), limits=limits, image_root=str(root / "images"))
    state = build_state(options, **QUIET)
    model, tokenizer = state.engine.adapters.model, state.tokenizer
    vision = vision_of(model, **QUIET)

    def expected(messages_text: str, images=()):
        content = with_images_first(messages_text, len(images))
        chat_images = ChatImages(tuple(images), vision) if images else None
        messages = [{"role": "user", "content": content}]
        return generate_reply(model, tokenizer, messages, images=chat_images, max_new_tokens=8)

    answers = {  # computed before the engine thread owns the model
        "image1": expected(QUESTION, [make_image(1)]),
        "inside": expected(QUESTION, [make_image(4)]),
        "text": expected("Tell me a story."),
    }
    with BackgroundServer(state) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield {"client": client, "model": str(folder), "state": state, "answers": answers}


def _chat(server, messages, **body):
    body = {
        "model": server["model"],
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        **body,
    }
    return server["client"].post("/v1/chat/completions", json=body)


def _answer(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_serve_answers_image_url_requests(qwen_server):
    answers = qwen_server["answers"]
    assert (
        _answer(_chat(qwen_server, _image_message(_data_url(make_image(1))))) == answers["image1"]
    )
    assert _answer(_chat(qwen_server, _image_message("inside.png"))) == answers["inside"]
    assert (
        _answer(_chat(qwen_server, [{"role": "user", "content": "Tell me a story."}]))
        == (answers["text"])
    )


def test_image_and_text_requests_decode_together(qwen_server):
    """Both requests wait while the scheduler is held, so they join the same batch: the
    image prompt prefilled alone (its pixels, its M-RoPE positions), then decoded in one
    batch with the text prompt (left padding, each row's own positions)."""
    answers, results = qwen_server["answers"], {}
    requests = {
        "text": [{"role": "user", "content": "Tell me a story."}],
        "image1": _image_message(_data_url(make_image(1))),
    }

    def send(name):
        results[name] = _answer(_chat(qwen_server, requests[name]))

    engine = qwen_server["state"].engine
    steps = engine.stats.peak_batch
    with Paused(engine):
        threads = [threading.Thread(target=send, args=(name,)) for name in requests]
        for thread in threads:
            thread.start()
        for _ in range(100):  # both in flight before the scheduler goes on
            if qwen_server["client"].get("/health").json()["requests_in_flight"] == 2:
                break
            threading.Event().wait(0.1)
    for thread in threads:
        thread.join(timeout=60)
    assert results == {name: answers[name] for name in requests}
    assert engine.stats.peak_batch >= max(steps, 2)


BAD = [
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "invalid_image", "not an image"),
    ("data:image/png;base64,@@@", "invalid_image", "base64"),
    ("https://example.com/cat.png", "image_url_not_supported", "does not download"),
    ("../outside.png", "image_path_not_allowed", "outside the image root"),
    ("missing.png", "invalid_image", "no such file"),
]


@pytest.mark.parametrize("url, code, why", BAD)
def test_bad_images_are_400_naming_why(qwen_server, url, code, why):
    response = _chat(qwen_server, _image_message(url))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and why in error["message"]
    assert error["param"] == "messages.0.content.0.image_url.url"


def test_image_limits_are_400_naming_the_flag(qwen_server):
    big = _data_url(make_image(0, size=(140, 140)))  # noise: ~59 kB of PNG
    error = _chat(qwen_server, _image_message(big)).json()["error"]
    assert error["code"] == "image_too_large" and "--max-image-size" in error["message"]
    wide = _data_url(make_image(0, colour=(9, 9, 9), size=(400, 100)))  # 40,000 pixels
    error = _chat(qwen_server, _image_message(wide)).json()["error"]
    assert error["code"] == "image_too_large" and "--max-image-pixels" in error["message"]
    small = {"type": "image_url", "image_url": {"url": _data_url(make_image(1))}}
    three = [{"role": "user", "content": [small, small, small]}]
    error = _chat(qwen_server, three).json()["error"]
    assert error["code"] == "too_many_images" and "--max-images" in error["message"]
    stray = [{"role": "user", "content": "<image> what is this?"}]
    error = _chat(qwen_server, stray).json()["error"]
    assert (
        error["param"] == "messages"
        and "1 <image> placeholder(s) but 0 image(s)" in (error["message"])
    )


def test_images_to_a_text_model_are_400(tiny_tokenizer, tmp_path):
    state, model_dir, _ = tiny_server_state(tiny_tokenizer, tmp_path)
    with BackgroundServer(state) as url:
        body = {"model": str(model_dir), "messages": _image_message(_data_url(make_image(1)))}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "images_not_supported" and str(model_dir) in error["message"]
