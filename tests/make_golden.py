"""Write the golden payloads (python -m tests.make_golden); tests keep decoding them.

A payload never outlives the build that made it (it exists only in flight between ranks
of one job), so only the current layout has to decode: when a codec's bytes change on
purpose, delete its fixture and run this again; an accidental change shows as a golden
payload that no longer decodes to what it did.
"""

from __future__ import annotations

import torch

from recsz.codecs import available_codecs, get_codec
from tests.common import FIXTURES, golden_input


def main() -> None:
    FIXTURES.mkdir(exist_ok=True)
    x = golden_input()
    x[0, 0] = float("nan")
    for name in available_codecs():
        path = FIXTURES / f"golden_{name.replace('+', '_')}.pt"
        if path.exists():
            continue
        c = get_codec(name)
        p = c.encode(x, 1e-2)
        torch.save({"payload": p, "decoded": c.decode(p)}, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
