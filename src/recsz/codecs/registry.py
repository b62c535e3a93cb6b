"""Codecs by name: ``get_codec("hybrid", level=3)``, and decoding any payload by its header."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from recsz.codecs.base import Codec
from recsz.codecs.payload import PayloadError, parse_payload

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec reachable by its ``codec_id``."""
    cid = cls.codec_id
    if cid in _REGISTRY and _REGISTRY[cid] is not cls:
        raise ValueError(f"codec id {cid!r} registered twice")
    _REGISTRY[cid] = cls
    return cls


def available_codecs() -> list[str]:
    """Names of every registered codec (optional ones included; they fail on use)."""
    return sorted(_REGISTRY)


def get_codec(name: str, **config: Any) -> Codec:
    """The codec registered as ``name``, built with keyword configuration."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown codec {name!r}; available: {', '.join(available_codecs())}"
        ) from None
    return cls.from_config(config)


def takes(name: str, option: str) -> bool:
    """Whether codec ``name``'s constructor takes ``option`` (``coder``: the quantizing
    codecs)."""
    get_codec(name)  # the unknown-name error
    return option in inspect.signature(_REGISTRY[name].__init__).parameters


def get_codec_with(name: str, **options: Any) -> Codec:
    """:func:`get_codec` with those ``options`` the codec's constructor takes (the rest
    do not apply to it), e.g. ``coder`` for the quantizing codecs only."""
    return get_codec(name, **{k: v for k, v in options.items() if takes(name, k)})


def decode_payload(payload: torch.Tensor) -> torch.Tensor:
    """Decode any payload with the codec and configuration its header names."""
    hdr, _ = parse_payload(payload, verify=False)  # the codec's decode checks the payload
    if hdr.codec not in _REGISTRY:
        raise PayloadError(f"payload names unknown codec {hdr.codec!r}")
    try:
        codec = _REGISTRY[hdr.codec].from_config(hdr.config)
    except (TypeError, ValueError) as e:
        raise PayloadError(f"payload's codec config is invalid: {e}") from None
    return codec.decode(payload)
