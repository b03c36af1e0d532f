"""pyghmi's fakebmc as the tests' IPMI BMCs: several in one process, one machine each, on 127.0.0.1.

    python fake_ipmi_bmc.py PORTS_FILE NAME=STATE[,QUIRK...] ...

The one user's name and password come from FAKE_BMC_USER and FAKE_BMC_PASSWORD. Each BMC listens on a free UDP
port of 127.0.0.1; once all do, PORTS_FILE gets their ports as JSON ({name: port}). Every login, logout, chassis
status read and chassis control is a line on stdout ("NAME status on", "NAME control shutdown"), for the tests to
read what the BMC was asked and answered.

STATE is the power state it starts in, on or off. QUIRKs: ignores-soft-off (an OS that ignores the ACPI shutdown
request), never-on (a machine that does not power on), any-cipher-suite (pyghmi's own server session, which says
yes to a cipher suite it does not do; see Session). Like hardware, a power change shows in the power state
only CHANGE_DELAY seconds after the BMC took it.

Run by tests/ipmi_fixtures.py; imports nothing of Shepherd.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pyghmi.cmd.fakebmc import FakeBmc
from pyghmi.ipmi import bmc as pyghmi_bmc
from pyghmi.ipmi.private import serversession

CHANGE_DELAY = 0.2
# RMCP+ status "no cipher suite match with proposed security algorithms" (IPMI 2.0, table 13-15).
NO_CIPHER_SUITE_MATCH = 0x11
QUIRKS = {"ignores-soft-off", "never-on", "any-cipher-suite"}


def say(line: str) -> None:
    print(line, flush=True)


class Session(serversession.ServerSession):
    """pyghmi's server session, but refusing a cipher suite it cannot do, and saying who logs in and out.

    pyghmi's server does cipher suite 3 (HMAC-SHA1, AES) only, yet says yes to whatever a client proposes; pyghmi's
    client proposes suite 17 (SHA-256) first, takes the yes, and fails on the SHA-1 answers. A BMC refuses a suite it
    cannot do, and then the client proposes suite 3: this one does the same.
    """

    def create_open_session_response(self, request: Any) -> Any:
        """The RMCP+ Open Session Response: a refusal unless the proposal is suite 3's algorithms."""
        proposal = (request[12], request[20], request[28]) if len(request) >= 32 else None
        if proposal != (1, 1, 1):
            self.clientsessionid = request[4:8]
            return bytearray([request[0], NO_CIPHER_SUITE_MATCH, 0, 0]) + bytearray(request[4:8])
        return super().create_open_session_response(request)

    def _send_rakp4(self, tagvalue: int, statuscode: int) -> None:
        # pyghmi sends RAKP4 only once the client proved it knows the password.
        say(f"{self.bmc.name} login {self.username.decode()}")
        super()._send_rakp4(tagvalue, statuscode)

    def close_server_session(self) -> None:
        """The client's Close Session."""
        say(f"{self.bmc.name} logout")


class Bmc(FakeBmc):
    """pyghmi's FakeBmc on 127.0.0.1 with a name, a slow power state and quirks."""

    def __init__(self, name: str, spec: str, authdata: dict[str, str], port: int) -> None:
        # FakeBmc.__init__ binds every address; the tests' BMCs keep to the loopback.
        pyghmi_bmc.Bmc.__init__(self, authdata, port, address="127.0.0.1")
        state, *quirks = spec.split(",")
        if state not in ("on", "off") or not set(quirks) <= QUIRKS:
            raise SystemExit(f"{name}: bad spec {spec!r}")
        self.name = name
        self.quirks = set(quirks)
        self.powerstate = state
        self.bootdevice = "default"
        self.pending: tuple[float, str] | None = None

    def sessionless_data(self, data: Any, sockaddr: Any) -> None:
        """An RMCP+ Open Session Request starts a Session of ours; anything else goes to pyghmi's."""
        if (
            "any-cipher-suite" not in self.quirks
            and len(data) >= 22
            and data[0] == 6
            and bytes(data[2:4]) == b"\xff\x07"
            and data[4] == 6
            and data[5] == 0x10
        ):
            Session(self.authdata, self.kg, sockaddr, self.serversocket, bytearray(data[16:]), self.uuid, bmc=self)
            return
        super().sessionless_data(data, sockaddr)

    def _change(self, state: str) -> None:
        self.pending = (time.monotonic() + CHANGE_DELAY, state)

    def get_power_state(self) -> str:
        """The power state, a change applied once its delay passed."""
        if self.pending is not None and time.monotonic() >= self.pending[0]:
            self.powerstate, self.pending = self.pending[1], None
        say(f"{self.name} status {self.powerstate}")
        return str(self.powerstate)

    def power_off(self) -> None:
        """A hard off."""
        say(f"{self.name} control off")
        self._change("off")

    def power_on(self) -> None:
        """Power on, unless the machine never comes on."""
        say(f"{self.name} control on")
        if "never-on" not in self.quirks:
            self._change("on")

    def power_shutdown(self) -> None:
        """The ACPI shutdown request, which the OS may ignore."""
        say(f"{self.name} control shutdown")
        if "ignores-soft-off" not in self.quirks:
            self._change("off")

    def power_cycle(self) -> None:
        """Not used by Shepherd; said, so a test sees it if it were."""
        say(f"{self.name} control cycle")

    def power_reset(self) -> None:
        """Not used by Shepherd; said, so a test sees it if it were."""
        say(f"{self.name} control reset")


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(ports_file: str, *specs: str) -> None:
    authdata = {os.environ["FAKE_BMC_USER"]: os.environ["FAKE_BMC_PASSWORD"]}
    bmcs = [Bmc(name, spec, authdata, free_udp_port()) for name, _, spec in (s.partition("=") for s in specs)]
    ready = Path(ports_file + ".tmp")
    ready.write_text(json.dumps({bmc.name: bmc.port for bmc in bmcs}))
    ready.rename(ports_file)
    # pyghmi's event loop serves every BMC of the process.
    Bmc.listen()


if __name__ == "__main__":
    main(*sys.argv[1:])
