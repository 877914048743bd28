"""Agent programs that send images through the proxy (``tests/test_proxy_images.py``): each row
holds two images as ``data:`` URIs (``first``, ``second``)."""

from __future__ import annotations

from proxy_agents import LOG, client


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def image_then_another(base_url: str, api_key: str, row: dict) -> float:
    """A chat call with the first image and a question; then, after the reply, a user message with
    the second image (as an environment's image observation would come); reward 1."""
    c = client(base_url, api_key)
    messages = [{"role": "user", "content": [_image(row["first"]), {"type": "text", "text": "colour?"}]}]
    for follow_up in ([_image(row["second"]), {"type": "text", "text": "and?"}], None):
        response = await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        LOG.setdefault(api_key, []).append(response.model_dump())
        if follow_up is None:
            break
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    return 1.0


async def responses_with_an_image(base_url: str, api_key: str, row: dict) -> float:
    """One Responses call whose input message holds the first image as ``input_image``; reward 1."""
    c = client(base_url, api_key)
    content = [{"type": "input_image", "image_url": row["first"]}, {"type": "input_text", "text": "colour?"}]
    await c.responses.create(model="policy", input=[{"role": "user", "content": content}], max_output_tokens=4)
    return 1.0


async def unreadable_image(base_url: str, api_key: str, row: dict) -> float:
    """A chat call whose image is not an image: the proxy answers 400, which the agent records."""
    import openai

    c = client(base_url, api_key)
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    try:
        await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": [bad]}], max_tokens=4)
    except openai.BadRequestError as exc:
        LOG.setdefault(api_key, []).append({"status": exc.status_code, "message": str(exc)})
    response = await c.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    LOG.setdefault(api_key, []).append(response.model_dump())
    return 0.0
