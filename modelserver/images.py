"""Images of chat requests: ``data:`` URLs decoded to ``HxWx3`` uint8 RGB arrays.

The model server makes no outbound calls, so an ``http(s)://`` image URL is refused with
a 400 that says to inline the image as a base64 ``data:`` URL. Anything Pillow cannot
decode is a 400 too.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np

from modelserver.errors import RequestError

__all__ = ["MAX_IMAGE_PIXELS", "MAX_REQUEST_PIXELS", "decode_data_url"]

#: Pillow's decompression-bomb guard, made explicit: bigger images are refused.
MAX_IMAGE_PIXELS = 64_000_000
#: All the images of one request together (decoded, each takes 3 bytes a pixel: 384 MB here). A blank
#: 8000x8000 PNG is 62 KB: eight of them (663 KB of JSON) took the model server to 2 GB.
MAX_REQUEST_PIXELS = 128_000_000


def decode_data_url(url: str, param: str, used_px: int = 0) -> np.ndarray:
    """``data:image/...;base64,...`` as an RGB array; :class:`RequestError` naming ``param`` otherwise.
    ``used_px``: the pixels of the request's images decoded before this one (:data:`MAX_REQUEST_PIXELS`)."""
    if url.startswith(("http://", "https://")):
        raise RequestError(
            f"{param}: image URLs are not fetched (this server makes no outbound requests); "
            "send the image inline as a data URL: data:image/png;base64,...", param=param)
    if not url.startswith("data:"):
        raise RequestError(f"{param}: expected a data URL (data:image/png;base64,...), got {url[:40]!r}", param=param)
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise RequestError(f"{param}: only base64 data URLs are supported (data:image/png;base64,...)", param=param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{param}: the data URL's payload is not valid base64", param=param) from None
    return _decode_image(raw, param, used_px)


def _decode_image(raw: bytes, param: str, used_px: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # imported at the first image: ~2 MiB a text model never needs

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                if image.width * image.height > MAX_IMAGE_PIXELS:
                    raise RequestError(f"{param}: the image is {image.width}x{image.height}, above "
                                       f"{MAX_IMAGE_PIXELS} pixels; send a smaller image", param=param)
                if used_px + image.width * image.height > MAX_REQUEST_PIXELS:
                    raise RequestError(f"{param}: this {image.width}x{image.height} image takes the request's images "
                                       f"above {MAX_REQUEST_PIXELS} pixels together; send fewer or smaller images",
                                       param=param)
                return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except RequestError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestError(f"{param}: could not decode the image (send PNG, JPEG, WebP, GIF or BMP)",
                           param=param) from None
