"""What is never shown: the credentials of a URL, secret option values, and any of them inside a message.

Used wherever settings, provider options or errors are shown (``shepherd config``, ``shepherd doctor``, a
process's start, log lines): a value is hidden as ``***``, its name kept, so the operator still sees what is set.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import unquote_plus

HIDDEN = "***"

# A query parameter whose name (percent-decoded, any case) has one of these in it holds a secret. Wide on purpose:
# hiding the value of a harmless parameter costs nothing, showing a key costs the key.
_SECRET_PARAMETER = re.compile(
    r"pass|pwd|secret|token|api_?key|access_?key|private_?key|credential|signature|(?:^|[_.-])sig(?:$|[_.-])",
    re.IGNORECASE,
)
# A provider option or setting named like this holds a secret itself, whatever its type declares: the name ends in
# one of these words (api_token, client_secret, password), which a file (password_file) or a variable's name
# (password_env) does not.
_SECRET_NAME = re.compile(
    r"(?:^|_)(?:password|passwd|passphrase|secret|token|api_?key|access_?key|secret_?key|private_?key|credentials?)$",
    re.IGNORECASE,
)
# A URL inside a message: a scheme, ://, and everything up to white space (a quote may be in a password), with the
# quote before it if it is quoted.
_URL_IN_TEXT = re.compile(r"(['\"]?)([A-Za-z][A-Za-z0-9+.-]*://\S+)")
# A query parameter's start: ? or &, its name, =. Its value runs to the next & (or, for a harmless one, to the
# next ? too, so that a second ? cannot smuggle a password past as part of another value).
_PARAMETER = re.compile(r"[?&]([^=&#?]*)=")


def secret_name(name: str) -> bool:
    """Whether an option or setting of that name holds a secret by its name alone (api_token, client_secret)."""
    return _SECRET_NAME.search(name) is not None


def redact_url(url: str) -> str:
    """The URL without its credentials, for messages and logs: the password of its user info and the value of each
    query parameter whose name says it is secret (password, sslpassword, token, api_key, ... also percent-encoded)
    become ***; the user name stays.

    The user info is read as libpq and browsers disagree on it, the wider way: everything before the last @ ahead
    of the first / after the host, so a password holding ?, # or @ (postgresql://u:pa?ss@host) is hidden whole.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    slash = rest.find("/")
    at = rest.rfind("@", 0, len(rest) if slash < 0 else slash)
    if at >= 0 and ":" in rest[:at]:
        user = rest[:at].split(":", 1)[0]
        rest = f"{user}:{HIDDEN}{rest[at:]}"
    return f"{scheme}://{_redact_parameters(rest)}"


def _redact_parameters(text: str) -> str:
    """text with the value of every secret query parameter hidden."""
    shown: list[str] = []
    position = 0
    while (found := _PARAMETER.search(text, position)) is not None:
        if not _SECRET_PARAMETER.search(unquote_plus(found.group(1))):
            shown.append(text[position : found.end()])
            position = found.end()
            continue
        end = text.find("&", found.end())
        end = len(text) if end < 0 else end
        shown.append(text[position : found.end()] + HIDDEN)
        position = end
    shown.append(text[position:])
    return "".join(shown)


def redact_text(text: str, secrets: Collection[Any] = ()) -> str:
    """text (an error, a log line) with every URL's credentials hidden, and every one of secrets that appears in it,
    as written or as Python quotes it."""
    for secret in secrets:
        if isinstance(secret, bool) or secret is None:
            continue
        # The quoted form first, so the quotes go with it.
        for form in (repr(secret), str(secret)):
            if form:
                text = text.replace(form, HIDDEN)
    return _redact_urls_in(text)


def _redact_urls_in(text: str) -> str:
    """text with the credentials of every URL in it hidden; a quoted URL ends at its last closing quote."""

    def redacted(found: re.Match[str]) -> str:
        quote, url = found.group(1), found.group(2)
        end = url.rfind(quote) if quote else -1
        return quote + (redact_url(url) if end < 0 else redact_url(url[:end]) + url[end:])

    return _URL_IN_TEXT.sub(redacted, text)


def redact_value(value: Any) -> Any:
    """A setting or option value as it may be shown: the credentials of every URL in it hidden, through tables and
    lists."""
    if isinstance(value, str):
        return _redact_urls_in(value)
    if isinstance(value, Mapping):
        return {key: HIDDEN if secret_name(str(key)) else redact_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(item) for item in value]
    return value


def redact_options(options: Mapping[str, Any], secret: Collection[str] | None) -> dict[str, Any]:
    """A provider instance's options as they may be shown: those its type marks secret (secret; None when the type
    cannot say: all of them) and those named as secrets are ***, URLs lose their credentials."""
    return {
        name: HIDDEN if secret is None or name in secret or secret_name(name) else redact_value(value)
        for name, value in options.items()
    }
