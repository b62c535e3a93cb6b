"""The checks' verdicts of received payloads, read to the host as seldom as a GPU allows.

A decode on a GPU checks its payloads there (checksums, stated sizes) and leaves one flag a
payload on the device; raising PayloadError for a failed one needs a host read, which makes
the host wait for the GPU. :func:`verdict` reads the flags at once, unless a
:class:`HeldChecks` holds them for one later read of many, or for a read of payload sizes
that happens anyway (:func:`read_sizes`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from recsz.codecs.payload import PayloadError

_held = threading.local()  # where verdict() puts its flags; the checks riding on read_sizes()

Held = list[tuple[torch.Tensor, Callable[[int], str]]]  # flags, and the error of a failed one


class HeldChecks:
    """The checks' verdicts of decodes, held back (on a GPU: flags on the device) to be read
    later, with one host read for many: a GPU waits once, not once a decode call. What
    :func:`verdict` gets inside :meth:`holding` waits here until :meth:`read`, or until a
    read of payload sizes that has to happen anyway takes it along (:func:`read_sizes`,
    inside :func:`riding`). Meanwhile what was decoded may be computed with, but nothing
    made from it may leave the process, nor change a parameter unless gated by
    :meth:`all_ok`."""

    def __init__(self) -> None:
        self._held: Held = []

    def __bool__(self) -> bool:
        return bool(self._held)

    @contextlib.contextmanager
    def holding(self, what: str = "") -> Iterator[None]:
        """Hold the verdicts made inside; ``what`` prefixes their errors' messages."""
        outer = getattr(_held, "verdicts", None)
        _held.verdicts = (self, what)
        try:
            yield
        finally:
            _held.verdicts = outer

    def add(self, ok: torch.Tensor, failed: Callable[[int], str], what: str = "") -> None:
        named = (lambda i: f"{what}: {failed(i)}") if what else failed
        self._held.append((ok.to(torch.bool).reshape(-1), named))

    def all_ok(self) -> torch.Tensor | None:
        """Whether every held check passed, where the flags are (no host read); None if
        none is held."""
        if not self._held:
            return None
        return torch.cat([ok for ok, _ in self._held]).all()

    def take(self) -> Held:
        """The held verdicts, given up: the caller reads them (:func:`raise_failed`)."""
        held, self._held = self._held, []
        return held

    def read(self) -> None:
        """Read every held verdict now (one host read); PayloadError for the first failure."""
        read_all(self)


def read_all(*checks: HeldChecks) -> None:
    """Read every verdict that ``checks`` hold, in one host read; PayloadError for the
    first failure."""
    held = [v for c in checks for v in c.take()]
    if held:
        raise_failed(torch.cat([ok for ok, _ in held]).tolist(), held)


@contextlib.contextmanager
def riding(*checks: HeldChecks) -> Iterator[None]:
    """Let a sizes read inside (:func:`read_sizes`) read what ``checks`` hold too."""
    outer = getattr(_held, "riders", ())
    _held.riders = checks
    try:
        yield
    finally:
        _held.riders = outer


def verdict(ok: torch.Tensor, failed: Callable[[int], str]) -> None:
    """Raise PayloadError(failed(i)) for the first payload i whose flag in ``ok`` (bool,
    one a payload) is False: now (one host read), or later if held (:class:`HeldChecks`)."""
    held = getattr(_held, "verdicts", None)
    if held is not None:
        held[0].add(ok, failed, held[1])
    else:
        raise_failed(ok.to(torch.bool).reshape(-1).tolist(), [(ok, failed)])


def read_sizes(sizes: torch.Tensor) -> list[int]:
    """``sizes.tolist()``, the one host read that payloads' sizes need; inside
    :func:`riding`, the riders' held verdicts are read along (then PayloadError for the
    first that failed)."""
    held = [v for checks in getattr(_held, "riders", ()) for v in checks.take()]
    if not held:
        return sizes.tolist()
    flags = torch.cat([ok for ok, _ in held]).to(device=sizes.device, dtype=sizes.dtype)
    values = torch.cat([sizes.reshape(-1), flags]).tolist()
    n = sizes.numel()
    raise_failed([bool(v) for v in values[n:]], held)
    return values[:n]


def raise_failed(flags: list[bool], held: Held) -> None:
    """PayloadError for the first False in ``flags``, ``held``'s flags read to the host."""
    at = 0
    for ok, failed in held:
        n = ok.numel()
        if not all(flags[at : at + n]):
            raise PayloadError(failed(flags[at : at + n].index(False)))
        at += n
