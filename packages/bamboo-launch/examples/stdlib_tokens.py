"""Write a token file from text that ships with Python: the standard library's source, one token per byte.

    python packages/bamboo-launch/examples/stdlib_tokens.py /tmp/stdlib.bin

The file is a flat array of little-endian uint16 token ids (here the bytes 0..255 of the source text), the
format nanoGPT-style preprocessing writes and ``bamboo.rc.data.TokenFile`` memory-maps. With a real
tokenizer you would write ``tokenizer(text)["input_ids"]`` the same way
(``bamboo.rc.data.write_token_file``).
"""

from __future__ import annotations

import argparse

import numpy as np
from bamboo.rc.data import stdlib_corpus, write_token_file


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the Python standard library's source as a byte-level token "
                                     "file (uint16).")
    parser.add_argument("out", help="the token file to write, e.g. /tmp/stdlib.bin")
    parser.add_argument("--bytes", type=int, default=4_000_000, help="how much of the source text (default: "
                        "%(default)s bytes)")
    args = parser.parse_args()
    tokens = np.frombuffer(stdlib_corpus(args.bytes), dtype=np.uint8)
    path = write_token_file(tokens, args.out, dtype="uint16")
    print(f"wrote {path}: {len(tokens)} tokens (vocabulary 256, uint16)")


if __name__ == "__main__":
    main()
