"""Codecs for the embedding all-to-all: ``get_codec(name).encode(x, eb)`` -> uint8 payload.

See :mod:`recsz.codecs.base` for the contract every codec keeps.
"""

from recsz.codecs import anchors as _anchors  # noqa: F401  (registers TorchRec's tr-* codecs)
from recsz.codecs import baselines as _baselines  # noqa: F401  (registers the baselines)
from recsz.codecs import hybrid as _hybrid  # noqa: F401  (registers hybrid and its stages)
from recsz.codecs import sparse as _sparse  # noqa: F401  (registers dct, dct-mask)
from recsz.codecs.base import Codec
from recsz.codecs.payload import PayloadError, parse_payload
from recsz.codecs.registry import (
    available_codecs,
    decode_payload,
    get_codec,
    get_codec_with,
    register_codec,
    takes,
)

__all__ = [
    "Codec",
    "PayloadError",
    "available_codecs",
    "decode_payload",
    "get_codec",
    "get_codec_with",
    "parse_payload",
    "register_codec",
    "takes",
]
