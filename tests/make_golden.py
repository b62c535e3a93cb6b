"""Write the golden payloads once (python -m tests.make_golden); tests keep decoding them.

When a codec's payload layout gains a new form, bump GENERATION: the new payloads go to
``golden_NAME.vN.pt`` beside the old ones, and every generation must keep decoding.
"""

from __future__ import annotations

import torch

from recsz.codecs import available_codecs, get_codec
from tests.common import FIXTURES, golden_input

#: Payload layout generation: 2 = split integer streams with range-coded references.
GENERATION = 2


def main() -> None:
    FIXTURES.mkdir(exist_ok=True)
    x = golden_input()
    x[0, 0] = float("nan")
    for name in available_codecs():
        c = get_codec(name)
        p = c.encode(x, 1e-2)
        stem = f"golden_{name.replace('+', '_')}"
        path = FIXTURES / f"{stem}.pt"
        if path.exists():
            path = FIXTURES / f"{stem}.v{GENERATION}.pt"
            old = torch.load(FIXTURES / f"{stem}.pt", weights_only=True)["payload"]
            if torch.equal(old, p):
                continue  # this codec's bytes did not change
        if path.exists():
            continue  # never overwrite: old payloads must keep decoding
        torch.save({"payload": p, "decoded": c.decode(p)}, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
