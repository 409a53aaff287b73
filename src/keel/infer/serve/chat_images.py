"""Chat requests with images: their `image_url` parts checked against the server's policy
and limits, decoded, and tokenized with the model's family plugin (keel.infer.vision)."""

from __future__ import annotations

from keel.errors import KeelError
from keel.infer.serve.images import ImagePolicy, ImageRef, load_request_images
from keel.infer.serve.limits import ApiError
from keel.infer.vision import ImagePrompt, encode_with_images
from keel.models.vision.family import PLACEHOLDER


def chat_turns(tokenizer, messages) -> list[dict]:
    """The messages as the chat template takes them (images as `<image>` placeholders);
    400 when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this model's tokenizer has no chat template; use /v1/completions",
            param="messages",
        )
    return [_turn(m) for m in messages]


def _turn(message) -> dict:
    """One message as a template takes it; tool fields only where the message has them."""
    role = "system" if message.role == "developer" else message.role
    turn = {"role": role, "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = [call.turn() for call in message.tool_calls]
    # Only tool turns carry these on: a `name` on other messages was always ignored, and
    # handing it to templates now would change how existing requests render.
    if message.role == "tool":
        for key in ("tool_call_id", "name"):
            if getattr(message, key) is not None:
                turn[key] = getattr(message, key)
    return turn


def image_refs(messages, state) -> list[ImageRef]:
    """The request's image parts, in order; 400 when the served model takes no images."""
    refs = [
        ImageRef(f"messages.{i}.content.{j}.image_url.url", url)
        for i, message in enumerate(messages)
        for j, url in message.image_urls()
    ]
    if refs and state.vision is None:
        raise ApiError(
            400,
            f"model {state.default_model} takes no images on this server (a text model); "
            "send text only, or serve a vision-language model",
            param=refs[0].param,
            code="images_not_supported",
        )
    return refs


def has_placeholder(messages, state) -> bool:
    """Whether a vision-language model's request writes `<image>` in its text (checked
    against the images it sends, so a stray placeholder is a 400, not a failed forward)."""
    return state.vision is not None and any(PLACEHOLDER in m.text() for m in messages)


def chat_prompt_with_images(state, messages, refs: list[ImageRef]) -> ImagePrompt:
    """Decode the request's images (400 for one the policy refuses or that does not
    decode) and tokenize the conversation with them (400 when placeholders and images
    do not pair up). CPU work: the routes run it in a worker thread."""
    from jinja2 import TemplateError

    turns = chat_turns(state.tokenizer, messages)
    policy = ImagePolicy(
        root=state.image_root,
        max_images=state.limits.max_images,
        max_bytes=state.limits.max_image_bytes,
        max_pixels=state.limits.max_image_pixels,
    )
    images = load_request_images(refs, policy)
    try:
        return encode_with_images(state.tokenizer, turns, images, state.vision)
    except KeelError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except (TemplateError, ValueError, TypeError) as e:
        raise ApiError(
            400, f"the chat template refused these messages: {e}", param="messages"
        ) from None
