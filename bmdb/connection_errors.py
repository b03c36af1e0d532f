"""Why BMDB could not be reached, in one line: for TLS, the cause and the URL parameter to fix.

libpq's own messages are correct but terse, sometimes span lines, and do not
say which part of database_url to change. The translations below key on
libpq's wording; a message they do not know is passed on as its first line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import psycopg
from psycopg.conninfo import conninfo_to_dict

from foundation.settings_report import redact_url


def libpq_url(url: str) -> str:
    """The ``postgresql://`` URL libpq takes, for a URL in SQLAlchemy's form too."""
    scheme, separator, rest = url.partition("://")
    return f"postgresql://{rest}" if separator and scheme in ("postgresql+psycopg", "postgres") else url


def first_line(error: BaseException) -> str:
    """The driver's own message, on one line, without SQLAlchemy's statement and background link."""
    cause = getattr(error, "orig", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return lines[0] if lines else type(cause).__name__


def connection_failure(url: str, error: BaseException) -> str:
    """One line on why connecting to BMDB at url failed, naming the URL parameter at fault; never the password."""
    cause = _tls_cause(url, str(getattr(error, "orig", None) or error))
    if cause is None:
        return f"BMDB at {redact_url(url)} is unreachable: {first_line(error)}"
    return f"cannot connect to BMDB at {redact_url(url)}: {cause}"


def _parameters(url: str) -> dict[str, str]:
    try:
        return {name: str(value) for name, value in conninfo_to_dict(libpq_url(url)).items() if value is not None}
    except psycopg.Error:
        # A URL libpq cannot parse fails before any TLS; the message says so without the parameters.
        return {}


def _file_problem(path: str, reason: str) -> str:
    """Why libpq could not read the file, in an operator's words.

    The reason libpq quotes is the newest error in OpenSSL's queue for the thread, which may be another TLS
    connection's ("shutdown while in init"), so a file that holds no PEM block is told by looking at it.
    """
    if reason in ("no certificate or crl found", "no start line") or "PEM" in reason or not _holds_pem(path):
        return "it holds no PEM certificate or key"
    return reason


def _holds_pem(path: str) -> bool:
    """Whether the file has a PEM block; True when it cannot be read, which libpq's own reason then tells."""
    try:
        with open(path, "rb") as file:
            return b"-----BEGIN " in file.read(1 << 20)
    except OSError:
        return True


# Each: a pattern in libpq's message, and the cause it means given the URL's parameters and the match.
_Explain = Callable[[dict[str, str], re.Match[str]], str]


def _root_missing(parameters: dict[str, str], found: re.Match[str]) -> str:
    if "sslrootcert" not in parameters:
        return (
            f"sslmode={parameters.get('sslmode', 'verify-full')} checks the server's certificate, but the URL names "
            f"no CA: add sslrootcert=PATH of the CA that issued BMDB's certificate (libpq's default, "
            f"{found['path']}, does not exist)"
        )
    return (
        f"the CA certificate file {found['path']} (sslrootcert) does not exist: give the CA that issued BMDB's "
        "certificate, or sslrootcert=system for the system's trust store"
    )


def _root_unreadable(parameters: dict[str, str], found: re.Match[str]) -> str:
    path = found["path"]
    return f"cannot read the CA certificate file {path} (sslrootcert): {_file_problem(path, found['reason'])}"


def _not_verified(parameters: dict[str, str], found: re.Match[str]) -> str:
    root = parameters.get("sslrootcert", "~/.postgresql/root.crt")
    trusted = "the system's trust store" if root == "system" else f"the CA in {root}"
    return (
        f"the server's certificate does not verify against {trusted} (sslrootcert): it is issued by another CA, "
        "or it has expired; give the CA that issued BMDB's certificate"
    )


def _wrong_name(parameters: dict[str, str], found: re.Match[str]) -> str:
    others = f" {found['others'].strip()}" if found["others"] else ""
    return (
        f"the server's certificate is for {found['names']}{others}, not {found['host']} (sslmode=verify-full "
        "checks the URL's host): connect by a name the certificate carries, or give the server a certificate "
        f"for {found['host']}"
    )


def _client_certificate_wanted(parameters: dict[str, str], found: re.Match[str]) -> str:
    certificate = parameters.get("sslcert")
    if certificate is None:
        return "the server demands a client certificate: add sslcert=PATH and sslkey=PATH to the URL"
    if not os.path.exists(certificate):
        # libpq sends no certificate, without a word, when the sslcert file is missing.
        return f"the client certificate file {certificate} (sslcert) does not exist; the server demands one"
    return f"the server refused the client certificate {certificate} (sslcert)"


def _client_certificate_refused(parameters: dict[str, str], found: re.Match[str]) -> str:
    certificate = parameters.get("sslcert", "~/.postgresql/postgresql.crt")
    return (
        f"the server refused the client certificate {certificate} (sslcert): it is not issued by a CA the server "
        "trusts (its ssl_ca_file), or it has expired"
    )


def _client_certificate_other_user(parameters: dict[str, str], found: re.Match[str]) -> str:
    certificate = parameters.get("sslcert", "~/.postgresql/postgresql.crt")
    return (
        f"the client certificate {certificate} (sslcert) is not for the user {found['user']}: its common name "
        "must be the URL's user, or be mapped to it in the server's pg_ident.conf"
    )


def _key_readable_by_others(parameters: dict[str, str], found: re.Match[str]) -> str:
    return (
        f"the client key {found['path']} (sslkey) is readable by others, and libpq refuses such a key: "
        f"chmod 600 {found['path']} (640 if root owns it)"
    )


def _key_missing(parameters: dict[str, str], found: re.Match[str]) -> str:
    return f"the client key file {found['path']} (sslkey) does not exist"


def _certificate_unreadable(parameters: dict[str, str], found: re.Match[str]) -> str:
    path = found["path"]
    return f"cannot read the client certificate file {path} (sslcert): {_file_problem(path, found['reason'])}"


def _key_unreadable(parameters: dict[str, str], found: re.Match[str]) -> str:
    path = found["path"]
    return f"cannot read the client key file {path} (sslkey): {_file_problem(path, found['reason'])}"


def _plain_text_refused(parameters: dict[str, str], found: re.Match[str]) -> str:
    return "the server accepts only TLS connections: add sslmode=verify-full and sslrootcert=PATH of its CA to the URL"


def _no_tls_at_server(parameters: dict[str, str], found: re.Match[str]) -> str:
    return (
        f"the server does not speak TLS, and the URL's sslmode={parameters.get('sslmode', 'require')} demands it: "
        "turn TLS on at the server (ssl = on)"
    )


_CAUSES: list[tuple[re.Pattern[str], _Explain]] = [
    (re.compile(r'root certificate file "(?P<path>[^"]*)" does not exist'), _root_missing),
    (re.compile(r'could not read root certificate file "(?P<path>[^"]*)": (?P<reason>.*)'), _root_unreadable),
    (re.compile(r"certificate verify failed"), _not_verified),
    (
        re.compile(
            r'server certificate for "(?P<names>[^"]*)"(?P<others> \(and \d+ other names?\))? '
            r'does not match host name "(?P<host>[^"]*)"'
        ),
        _wrong_name,
    ),
    (re.compile(r"connection requires a valid client certificate"), _client_certificate_wanted),
    (
        re.compile(r"alert (unknown ca|bad certificate|certificate unknown|certificate expired)"),
        _client_certificate_refused,
    ),
    (re.compile(r'certificate authentication failed for user "(?P<user>[^"]*)"'), _client_certificate_other_user),
    (re.compile(r'private key file "(?P<path>[^"]*)" has group or world access'), _key_readable_by_others),
    (re.compile(r'certificate present, but not private key file "(?P<path>[^"]*)"'), _key_missing),
    (re.compile(r'could not read certificate file "(?P<path>[^"]*)": (?P<reason>.*)'), _certificate_unreadable),
    (re.compile(r'could not load private key file "(?P<path>[^"]*)": (?P<reason>.*)'), _key_unreadable),
    (re.compile(r"pg_hba\.conf rejects connection .* no encryption"), _plain_text_refused),
    (re.compile(r"server does not support SSL, but SSL was required"), _no_tls_at_server),
]


def _tls_cause(url: str, message: str) -> str | None:
    """The cause, when libpq's message is about TLS; None for any other failure."""
    parameters = _parameters(url)
    # libpq tries each address of the host in turn, a line each: the TLS line is the one that tells.
    for line in message.splitlines():
        for pattern, explain in _CAUSES:
            found = pattern.search(line)
            if found is not None:
                return explain(parameters, found)
    return None
