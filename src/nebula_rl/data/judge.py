"""What a vision-language judge of generated clips is asked (the reward service's
`reasoner_judge`, `nebula_rl.rewards.judge`), and `builtin:brightness_judge`, a task that teaches
a small reasoner to answer it.

The judge is shown a clip (a video at :data:`JUDGE_FPS` frames a second; one frame: an image)
with :data:`JUDGE_QUESTION` about the clip's prompt, and scores it by the probability of "yes"
against "no". A real judge (Cosmos-Reason, Cosmos 3's reasoner) answers from what it has learnt;
a tiny preset at random init answers at random. `builtin:brightness_judge` gives SFT rows that
make its answer a known function of the clip, the generated clips' brightness, so that a
generator trained against the judge has a reward it can raise: each row is a clip of random
frames at a random mean brightness b, a caption, the question, and the answer "yes" with
probability min(1, 2 b), drawn per row, whatever the caption. Trained on enough rows, the
judge's P(yes) approaches min(1, 2 b).
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

__all__ = ["JUDGE_FPS", "JUDGE_QUESTION", "brightness_judge_task", "judge_messages"]

JUDGE_QUESTION = 'Does this {kind} show the following? "{prompt}" Answer yes or no.'
"""What the judge is asked of each sample (`kind`: image or video)."""
JUDGE_FPS = 2.0
"""The frame rate a clip is shown to the judge at."""

_COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "white", "black")
_SHAPES = ("square", "circle", "bar", "dot", "ring")


def judge_messages(frames: list[Any], prompt: str) -> list[dict[str, Any]]:
    """The user turn that asks the judge about `frames` (image sources: PIL images, `data:`
    URIs, ...; one frame is shown as an image) and `prompt`."""
    kind = "image" if len(frames) == 1 else "video"
    media: dict[str, Any] = (
        {"type": "image", "image": frames[0]}
        if kind == "image"
        else {"type": "video", "video": list(frames), "fps": JUDGE_FPS}
    )
    text = {"type": "text", "text": JUDGE_QUESTION.format(kind=kind, prompt=prompt)}
    return [{"role": "user", "content": [media, text]}]


def brightness_judge_task(
    *,
    num_samples: int = 2000,
    frames: int = 5,
    size: int = 16,
    max_brightness: float = 0.7,
    seed: int = 0,
    **unknown: Any,
) -> list[dict[str, Any]]:
    """SFT rows that teach a judge to say "yes" to a clip of `frames` frames of `size` x `size`
    pixels with probability min(1, 2 b), b its mean brightness in [0, 1] (drawn uniformly up to
    `max_brightness`; see the module docstring). A clip is blotches of colour (a random 4 x 4
    grid per frame, scaled up smoothly) with pixel noise, its contrast random, shifted to its
    brightness. Rows: `conversations` (the question and the answer), `prompt` (the question
    alone), `answer`, and `brightness` (the measured b)."""
    if unknown:
        raise ValueError(f"builtin:brightness_judge: unknown option(s) {sorted(unknown)}")
    if num_samples < 1 or frames < 1 or size < 4 or not 0.0 < max_brightness <= 1.0:
        raise ValueError(
            "builtin:brightness_judge: need num_samples >= 1, frames >= 1, size >= 4 and "
            "0 < max_brightness <= 1"
        )
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    noise = np.random.default_rng(seed)
    rows = []
    for _ in range(num_samples):
        target, contrast = rng.uniform(0.0, max_brightness), rng.uniform(0.0, 0.5)
        blotches = noise.random((frames, 4, 4, 3), dtype=np.float32)
        clip = np.stack(
            [
                np.asarray(
                    Image.fromarray((b * 255).astype(np.uint8)).resize(
                        (size, size), Image.Resampling.BILINEAR
                    ),
                    dtype=np.float32,
                )
                / 255
                for b in blotches
            ]
        )
        clip = clip + noise.normal(0.0, 0.1, clip.shape).astype(np.float32)
        clip = (clip - clip.mean()) * contrast / max(float(clip.std()), 1e-6) + target
        pixels = (np.clip(clip, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
        brightness = float(pixels.mean()) / 255
        caption = f"a {rng.choice(_COLOURS)} {rng.choice(_SHAPES)}"
        answer = "yes" if rng.random() < min(1.0, 2 * brightness) else "no"
        user = judge_messages([_png_uri(frame) for frame in pixels], caption)
        rows.append(
            {
                "conversations": [*user, {"role": "assistant", "content": answer}],
                "prompt": user,
                "answer": answer,
                "brightness": brightness,
            }
        )
    return rows


def _png_uri(frame: Any) -> str:
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(frame).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
