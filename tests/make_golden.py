"""Write the golden payloads once (python -m tests.make_golden); tests keep decoding them."""

from __future__ import annotations

import torch

from recsz.codecs import available_codecs, get_codec
from tests.common import FIXTURES, golden_input


def main() -> None:
    FIXTURES.mkdir(exist_ok=True)
    x = golden_input()
    x[0, 0] = float("nan")
    for name in available_codecs():
        c = get_codec(name)
        p = c.encode(x, 1e-2)
        path = FIXTURES / f"golden_{name.replace('+', '_')}.pt"
        if path.exists():
            continue  # never overwrite: old payloads must keep decoding
        torch.save({"payload": p, "decoded": c.decode(p)}, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
