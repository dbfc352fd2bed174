"""Read CUDA fat binaries embedded in a library (what cuobjdump --list-elf would print)."""

from __future__ import annotations

import struct

_MAGIC = struct.pack("<I", 0xBA55ED50)
KIND_PTX, KIND_ELF = 1, 2


def entries(data: bytes) -> list[tuple[int, int]]:
    """(kind, sm) of every entry of every fatbin in ``data``; sm 90 means sm_90."""
    out: list[tuple[int, int]] = []
    i = data.find(_MAGIC)
    while i >= 0:
        _version, header, size = struct.unpack_from("<HHQ", data, i + 4)
        j, end = i + header, i + header + size
        while j + 32 <= min(end, len(data)):
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, j)
            out.append((kind, struct.unpack_from("<I", data, j + 28)[0]))
            if entry_header == 0:
                break
            j += entry_header + payload
        i = data.find(_MAGIC, i + 4)
    return out
