"""The tokenizer helper process (`Tokenizer.use_helper_process`): tokenizes long texts away from the serving
process, whose threads would otherwise wait for the GIL while tokenizers' encode runs (seconds for megabytes).

Protocol over stdin/stdout, each message a little-endian u64 length and that many bytes: first the tokenizer's JSON,
then any number of UTF-8 texts, each answered with its token ids as int32. EOF on stdin ends it (the parent is gone).
"""

from __future__ import annotations

import os
import struct
import sys


def read_message(stream) -> bytes | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    return data if len(data) == size else None


def write_message(stream, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def main() -> None:
    import numpy as np
    import tokenizers

    try:  # a megabytes-long prompt must not take CPU time from the engine's steps or the server's event loop
        os.nice(10)
    except OSError:
        pass
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    spec = read_message(inp)
    if spec is None:
        return
    tok = tokenizers.Tokenizer.from_str(spec.decode())
    while (text := read_message(inp)) is not None:
        ids = tok.encode(text.decode("utf-8", "surrogatepass"), add_special_tokens=False).ids
        write_message(out, np.asarray(ids, np.int32).tobytes())


if __name__ == "__main__":
    main()
