"""Text from outside, made safe to quote: one printable line, its control characters shown, cut to a length.

What a machine, a BMC or a provider says (an SSH disconnect reason, a Redfish error body, a command's output)
is quoted in errors, the event log, payloads and the history, through every continue-as-new. Whoever writes it
could make it long enough to fill them or put terminal escapes and line breaks in it that forge log lines or
rewrite an operator's terminal; quoted through this, it is neither.
"""

from __future__ import annotations

# The length of a quote when its caller names none.
DEFAULT_LIMIT = 500
# Shorter than this, a limit leaves no room for the marker that says how much was cut.
MIN_LIMIT = 40

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(char: str) -> str:
    """A character as it may be shown: itself when printable, else its escape (ESC is \\x1b)."""
    if char.isprintable():
        return char
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _marker(cut: int) -> str:
    return f"... [{cut} more chars cut]"


def foreign_text(value: str | bytes | object, limit: int = DEFAULT_LIMIT) -> str:
    """value on one line of printable characters, at most limit long: every character that is not printable
    (line breaks, ESC, other control and format characters) written as its escape, and when it does not fit,
    its start followed by a marker saying how many characters were cut. Bytes are read as UTF-8, each byte
    that is not shown as its escape; anything else as its str(). Printable text that fits comes back as it was,
    so quoting twice changes nothing."""
    if limit < MIN_LIMIT:
        raise ValueError(f"a quote of foreign text needs a limit of at least {MIN_LIMIT} characters, got {limit}")
    if isinstance(value, bytes):
        text = value.decode(errors="backslashreplace")
    else:
        text = value if isinstance(value, str) else str(value)
    # An escape is never shorter than its character: the first limit characters fill the line, or all of it.
    head = [_visible(char) for char in text[:limit]]
    if len(text) <= limit and sum(map(len, head)) <= limit:
        return "".join(head)
    # The marker counts what is left out; room is kept for the longest it can be, with every character cut.
    room = limit - len(_marker(len(text)))
    kept, length = 0, 0
    while kept < len(head) and length + len(head[kept]) <= room:
        length += len(head[kept])
        kept += 1
    return "".join(head[:kept]) + _marker(len(text) - kept)
