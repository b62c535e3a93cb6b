"""The codec contract and the self-describing payload.

Contract (every codec must):
- turn a 2-D float tensor (rows = embedding vectors or their gradients) into a 1-D
  ``torch.uint8`` payload on the same device, and back, with nothing but the bytes;
- if ``error_bounded``: guarantee ``|x - decode(encode(x, eb))| <= eb`` for every finite
  element; NaN and +-Inf always come back exactly (carried as outliers);
- if ``lossless``: return the input bit for bit;
- be stateless: the same input and bound give the same bytes (the policy holds state);
- reject a truncated, corrupted or foreign payload with :class:`PayloadError`, never
  returning a wrong tensor;
- describe its configuration as JSON (``get_config``) from which ``from_config`` rebuilds it.

The payload's layout and parsing live in :mod:`recsz.codecs.payload`. Its body = sections:
the codec's own bytes, then the positions and exact values of "outliers". Non-finite values
are taken out by this base class before a codec sees the tensor; a codec may name elements
it cannot represent within the bound; an external compressor whose bound is not exact by
construction (ZFP) is decoded and checked here. All of them travel exactly, so every codec
treats them the same way. A bounded codec's payload never holds more than the values stored
(one section, exact) and its header, however tight the bound.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from abc import ABC
from typing import Any, ClassVar

import numpy as np
import torch

from recsz.codecs import castframe, framing
from recsz.codecs.payload import (
    BLOCK_FORMAT,
    CAST_FORMAT,
    DTYPES,
    Header,
    PayloadError,
    as_bytes,
    assemble,
    assembled_nbytes,
    cheaper_sections,
    header_fields,
    pack_outliers,
    parse_payload,
    split_sections,
    stored_values,
    unpack_outliers,
    version_of,
)
from recsz.devicepath import device_path

Body = bytes | np.ndarray | tuple[bytes | np.ndarray, torch.Tensor]

#: The bounds a bounded codec accepts: from the smallest normal float32 (below it, steps
#: of 2 eb are subnormal and lose the precision the bound needs) to 1e38 (2 eb, and codes
#: times it, must stay finite in float32). Training floors relative bounds at 1e-30.
EB_MIN = float(torch.finfo(torch.float32).tiny)
EB_MAX = 1e38


def saturating_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` as ``dtype``, finite values clamped to its largest finite magnitude (a plain
    cast turns values beyond it into Inf, as fbgemm's FP16 comms do not)."""
    big = torch.finfo(dtype).max
    if torch.finfo(y.dtype).max > big:
        # Clamp where the limit is exact: bfloat16 rounds float16's 65504 up to 65536.
        # Infinities stay infinite (and NaN NaN): only finite values saturate.
        wide = y if y.dtype == torch.float64 else y.float()
        y = torch.where(torch.isinf(wide), wide, wide.clamp(-big, big))
    return y.to(dtype)


class Codec(ABC):
    """Base class: validation, header, non-finite handling; subclasses code the body."""

    codec_id: ClassVar[str]
    version: ClassVar[int] = 1
    error_bounded: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    #: The bound is a magnitude threshold (entries below it are dropped): the trainer
    #: gives such a codec the DCT threshold policy instead of an error-bound policy.
    threshold: ClassVar[bool] = False
    #: Backward only: sends the entries the forward pass kept, so the exchange masks the
    #: gradient with the received embeddings' support (needs a ``threshold`` forward codec).
    forward_mask: ClassVar[bool] = False
    #: Codes rows independently of each other and takes no bound, so a block of several
    #: tables' rows coded as one chunk decodes to what per-table chunks would: the
    #: exchange then codes a destination's tables together (one header, one call).
    joinable: ClassVar[bool] = False
    #: The payload carries the tensor's bytes unchanged: a rank's own rows skip the codec.
    identity: ClassVar[bool] = False

    # ---- configuration --------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable keyword arguments that rebuild this codec."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        return cls(**config)

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({cfg})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self), json.dumps(self.get_config(), sort_keys=True)))

    def check_installed(self) -> None:
        """An ImportError naming what to install, where the library this codec calls is
        missing (checked before any rank starts; the codecs built on torch need none)."""
        return None

    # ---- what subclasses implement --------------------------------------------------
    # A codec implements either _encode/_decode (host bytes) or _encode_tensor/
    # _decode_tensor (torch operations on the tensor's device, which then serve both its
    # host path and a device path for CUDA tensors, with no host copies there).
    def _encode(self, x: torch.Tensor, eb: float) -> Body:
        """Code a finite, contiguous 2-D tensor (N > 0 elements) into body bytes.

        May return ``(bytes, positions)``: flat positions of elements the codec could not
        represent within the bound; the base class then carries them exactly.
        """
        if not self._tensor_body():
            raise NotImplementedError(f"{type(self).__name__} codes no body")
        return self._encode_tensor(x).cpu().numpy()

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        """Rebuild the tensor from body bytes; raise PayloadError on malformed bodies."""
        if not self._tensor_body():
            raise NotImplementedError(f"{type(self).__name__} decodes no body")
        core = torch.from_numpy(body if body.flags.writeable else body.copy())
        return self._decode_tensor(core, h.shape, h.dtype, h.eb).to(device)

    def _encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """The body of a finite, contiguous 2-D tensor as a 1-D uint8 tensor on its device."""
        raise NotImplementedError

    def _decode_tensor(
        self, core: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, eb: float
    ) -> torch.Tensor:
        """Inverse of :meth:`_encode_tensor` (``core`` may sit at any byte offset); raise
        PayloadError when its size does not fit the shape."""
        raise NotImplementedError

    @classmethod
    def _tensor_body(cls) -> bool:
        return cls._encode_tensor is not Codec._encode_tensor

    #: Subclasses whose bound is not exact by construction set this: the encoder then
    #: decodes, and carries every element that misses the bound exactly.
    verify_bound: ClassVar[bool] = False
    #: ``_encode`` carries NaN/Inf elements itself (in its body, or among the outlier
    #: positions it reports), so the separate finiteness pass is skipped.
    takes_nonfinite: ClassVar[bool] = False

    def cast_width(self, dtype: torch.dtype) -> int | None:
        """Bytes per value of a body that is a plain cast of each value, NaN and Inf kept
        (format 4 then carries it from a GPU with no host sync); None otherwise."""
        return None

    def warm_up(self) -> None:  # noqa: B027  (a hook: most codecs have nothing to warm)
        """Pay one-time costs (loading compiled kernels) now rather than in the first step
        a benchmark times. No-op unless a codec has such costs."""

    # ---- public API -----------------------------------------------------------------
    def _validated(self, x: torch.Tensor, eb: float | None) -> float:
        """Check the input; the bound as a float (0 for codecs that take none)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{self.codec_id}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            raise ValueError(
                f"{self.codec_id}: expected a float tensor (float32/16, bfloat16, float64), "
                f"got {x.dtype}"
            )
        if x.dim() != 2:
            raise ValueError(
                f"{self.codec_id}: expected a 2-D tensor (rows, dim), got shape {tuple(x.shape)}"
            )
        if self.error_bounded and (eb is None or not EB_MIN <= eb <= EB_MAX):
            raise ValueError(
                f"{self.codec_id}: error bound {eb} is outside the accepted range "
                f"[{EB_MIN:.7g}, {EB_MAX:g}]"
            )
        return float(eb) if (self.error_bounded and eb is not None) else 0.0

    def encode(self, x: torch.Tensor, eb: float | None = None) -> torch.Tensor:
        """Encode ``x`` (2-D float) under absolute bound ``eb`` into a uint8 payload."""
        eb_f = self._validated(x, eb)
        if self._own_format(x):  # a group of one table
            ebs = torch.tensor([eb_f], dtype=torch.float64).to(x.device)
            return self._encode_own_groups([(x.detach(), [x.shape[0]])], ebs, True)[0][0]
        return self._encode_on_host(x.detach().cpu(), eb_f).to(x.device)

    def _encode_on_host(self, x: torch.Tensor, eb_f: float) -> torch.Tensor:
        """Format 1 of a CPU tensor (bodies coded on the host)."""
        device = x.device
        x = x.contiguous()
        exact: list[torch.Tensor] = []  # flat positions carried exactly
        orig = x
        if not self.takes_nonfinite:
            x, nonfinite = without_nonfinite(x)
            if nonfinite is not None:
                exact.append(nonfinite)
        core: bytes | np.ndarray = b""
        if x.numel():
            out = self._encode(x, eb_f)
            if isinstance(out, tuple):
                out, missed = out
                if missed.numel():
                    exact.append(missed)
            core = out
            if self.error_bounded and self.verify_bound:
                h = Header(self.codec_id, self.version, {}, x.dtype, tuple(x.shape), eb_f, 0)
                y = self._decode(np.frombuffer(as_bytes(core), np.uint8), h, device)
                bad = (y.double() - x.double()).abs().view(-1) > eb_f
                exact.append(torch.nonzero(bad).view(-1))
        outliers: list[bytes] = [b"", b""]
        if exact:
            idx = torch.unique(torch.cat(exact)) if len(exact) > 1 else exact[0]
            outliers = pack_outliers(idx, orig.view(-1)[idx])

        def fields(body_len: int) -> bytes:
            return self._header_fields(x.shape, x.dtype, eb_f, body_len)

        sections = [core, *outliers]
        if self.error_bounded and not self.threshold and orig.numel():
            # A bound too tight for the codes (every element an outlier) must not send
            # more than the values themselves. (A threshold's dropped entries stay
            # dropped: the backward masks by them.)
            sections = cheaper_sections(fields, sections, orig)
        return assemble(fields, sections).to(device)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """Rebuild the tensor; raises PayloadError if the bytes are not a valid payload."""
        v = version_of(payload)
        if v == CAST_FORMAT:
            return self._decode_casts([payload], None, True)[0]
        if v == BLOCK_FORMAT:
            return self._decode_blocks([payload])[0]
        hdr, body = parse_payload(payload)
        if hdr.codec != self.codec_id:
            raise PayloadError(f"payload was made by codec {hdr.codec!r}, not {self.codec_id!r}")
        assert isinstance(body, np.ndarray)
        return self._decode_body(hdr, body, payload.device)

    # ---- groups of tables: what one destination gets in a step ------------------------
    def segments_on(self, device: torch.device) -> bool:
        """True when this codec codes a group of tables in a format of its own on
        ``device``, sync-free (format 3 or 4); otherwise a group is framed chunks."""
        return device_path(device) and self.cast_width(torch.float32) is not None

    def _own_format(self, x: torch.Tensor) -> bool:
        """True when :meth:`encode` codes the chunk ``x`` in this codec's own group format
        (a codec may send some dtypes through the host instead)."""
        return self.segments_on(x.device)

    def encode_segments(
        self,
        groups: list[tuple[torch.Tensor, list[int]]],
        ebs: torch.Tensor | None,
        trim: bool = True,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One payload per group (rows, rows per table), ``ebs`` a bound per table (all
        groups in order; None for codecs that take none), and the payloads' lengths.
        ``trim=False``: payloads may keep their whole capacity and live in memory that
        the next call of the same shapes reuses (for payloads that never leave this
        process); by default a chunk per table, framed (:mod:`recsz.codecs.framing`)."""
        if groups and self.segments_on(groups[0][0].device):  # as decode_segments decides
            return self._encode_own_groups(groups, ebs, trim)
        return framing.encode_groups(self, groups, ebs)

    def decode_segments(
        self,
        payloads: list[torch.Tensor],
        sizes: list[list[int]] | None = None,
        dim: int = 0,
        check: bool = True,
    ) -> list[torch.Tensor]:
        """The rows of each group payload; ``sizes``/``dim``: what the caller expects.
        ``check=False``: the payloads are this process's own (no checks need reading)."""
        if payloads and self.segments_on(payloads[0].device):
            return self._decode_own_groups(payloads, sizes, dim, check)
        return framing.decode_groups(self, payloads, sizes, dim)

    def group_nbytes(
        self, rows: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> int | None:
        """The length of :meth:`encode_segments`' payload for a group of ``rows`` x ``dim``
        values of ``dtype`` on ``device`` where the shape alone sets it (the casts: a
        receiver then knows what arrives, and no sizes need exchanging); None where the
        values do."""
        width = self.cast_width(dtype)
        if width is None or not (self.joinable and self.takes_nonfinite):
            return None
        if self.segments_on(device):
            return castframe.nbytes(self.codec_id, dtype, rows, dim, width)

        def fields(body_len: int) -> bytes:
            return self._header_fields(torch.Size((rows, dim)), dtype, 0.0, body_len)

        return assembled_nbytes(fields, [rows * dim * width, 0, 0])  # no outlier sections

    def _encode_own_groups(
        self, groups: list[tuple[torch.Tensor, list[int]]], ebs: torch.Tensor | None, trim: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`encode_segments` where :meth:`segments_on`: format 4 (the casts); a
        codec with a group format of its own overrides this and the decoder below."""
        return castframe.encode(self.codec_id, self._encode_tensor, groups)

    def _decode_own_groups(
        self, payloads: list[torch.Tensor], sizes: list[list[int]] | None, dim: int, check: bool
    ) -> list[torch.Tensor]:
        expect = [(sum(s), dim) for s in sizes] if sizes is not None else None
        return self._decode_casts(payloads, expect, check)

    def _decode_casts(
        self, payloads: list[torch.Tensor], expect: list[tuple[int, int]] | None, check: bool
    ) -> list[torch.Tensor]:
        if self.cast_width(torch.float32) is None:
            raise PayloadError(f"{self.codec_id} does not read format-{CAST_FORMAT} payloads")

        def width(dtype: torch.dtype) -> int:
            return self.cast_width(dtype) or 0

        return castframe.decode(self.codec_id, self._decode_tensor, width, payloads, expect, check)

    def _decode_blocks(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode format-3 payloads (codecs that write them override this)."""
        raise PayloadError(f"{self.codec_id} does not read format-{BLOCK_FORMAT} payloads")

    # ---- internals ------------------------------------------------------------------
    @functools.cached_property
    def _config_bytes(self) -> bytes:
        """The header's config: only settings that differ from the constructor's defaults
        travel (from_config fills the rest), so small chunks pay ~10 fewer header bytes.
        Computed once per codec (codecs are configured at construction and never change):
        inspecting the signature costs more than coding a small chunk."""
        defaults = {
            k: p.default
            for k, p in inspect.signature(type(self).__init__).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        shown = {k: v for k, v in self.get_config().items() if defaults.get(k, object()) != v}
        return json.dumps(shown, sort_keys=True, separators=(",", ":")).encode() if shown else b""

    def _decode_body(self, hdr: Header, body: np.ndarray, device: torch.device) -> torch.Tensor:
        shape, dtype = hdr.shape, hdr.dtype
        stored = stored_values(body, shape, dtype)
        if stored is not None:
            return stored.to(device)
        core, oidx, oval = split_sections(body, 3)
        n = math.prod(shape) if shape else 0
        if n == 0:
            if core.size or oidx.size > 1 or oval.size:
                raise PayloadError("an empty tensor's payload carries data")
            return torch.empty(shape, dtype=dtype, device=device)
        try:
            y = self._decode(core, hdr, device)
        except PayloadError:
            raise
        except Exception as e:  # a malformed body must never escape as another error
            raise PayloadError(f"{self.codec_id}: corrupt body ({type(e).__name__}: {e})") from e
        if tuple(y.shape) != shape or y.dtype != dtype:
            raise PayloadError(
                f"{self.codec_id}: body decodes to {tuple(y.shape)} {y.dtype}, "
                f"header says {shape} {dtype}"
            )
        if oidx.size or oval.size:
            y = y.contiguous()
            idx, val = unpack_outliers(oidx, oval, dtype, n)
            if idx.numel():
                y.view(-1)[idx.to(y.device)] = val.to(y.device)
        return y

    def _header_fields(self, shape: torch.Size, dtype: torch.dtype, eb: float, blen: int) -> bytes:
        cfg = self._config_bytes
        return header_fields(self.codec_id, self.version, cfg, shape, dtype, eb, blen)


def without_nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (contiguous) with NaN/Inf zeroed, and their flat positions (None when every
    element is finite): those elements travel exactly, whatever the codec. A finite sum
    means every element is finite (NaN/Inf propagate): one cheap pass in the usual case."""
    flat = x.view(-1)
    if not flat.numel() or bool(torch.isfinite(flat.sum())):
        return x, None
    bad = ~torch.isfinite(flat)
    pos = torch.nonzero(bad).view(-1)
    if not pos.numel():  # the sum overflowed, every element is finite
        return x, None
    return x.masked_fill(bad.view(x.shape), 0), pos
