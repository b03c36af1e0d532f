"""ELF files of other machines, made here: what the worker reads of an agent built for another kind of machine."""

from __future__ import annotations

import json
import struct


def elf(machine: int, *, interpreter: bytes | None = b"/lib64/ld-linux-x86-64.so.2", manifest: dict | None = None):
    """A whole little-endian 64-bit ELF file for e_machine machine, with a PT_INTERP and a shepherd_agent section
    when asked: what the worker reads of an agent built for another kind of machine."""
    header_size, program_header_size, section_header_size = 64, 56, 64
    body = bytearray()
    program_headers = b""
    data_at = header_size + program_header_size
    if interpreter is not None:
        interp = interpreter + b"\0"
        program_headers = struct.pack("<IIQQQQQQ", 3, 4, data_at, 0, 0, len(interp), len(interp), 1)
        body += interp
    sections = b""
    names_at = data_at + len(body)
    section_count, names_index = 0, 0
    if manifest is not None:
        names = b"\0shepherd_agent\0.shstrtab\0"
        content = json.dumps(manifest).encode()
        body += names + content
        content_at = names_at + len(names)
        sections_at = data_at + len(body)
        sections = (
            bytes(section_header_size)
            + struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, content_at, len(content), 0, 0, 1, 0)
            + struct.pack("<IIQQQQIIQQ", 16, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
        )
        section_count, names_index = 3, 2
    else:
        sections_at = 0
    header = (
        b"\x7fELF\x02\x01\x01"
        + bytes(9)
        + struct.pack(
            "<HHIQQQIHHHHHH",
            2,
            machine,
            1,
            0x400000,
            header_size if program_headers else 0,
            sections_at,
            0,
            header_size,
            program_header_size,
            1 if program_headers else 0,
            section_header_size,
            section_count,
            names_index,
        )
    )
    padding = bytes(program_header_size - len(program_headers)) if program_headers else bytes(program_header_size)
    return bytes(header + program_headers + padding + body + sections)


AARCH64 = 183
