"""The heartbeat server process: the agent callback service (processes.heartbeat_service) on gRPC over TLS, its
serving certificate read again when its files change, and a supervisor for several processes on one port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import resource
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
from cryptography import x509
from sqlalchemy.exc import SQLAlchemyError

from bmdb.migrate import open_bmdb
from foundation.agent_trust import AgentTrust
from foundation.bmdb_tls import log_bmdb_tls_warnings
from foundation.logs import configure_logging
from foundation.metrics import (
    HEARTBEAT_SERVER_CERTIFICATE,
    CertificateExpiry,
    meter_of,
    metrics_runtime,
)
from foundation.setting_values import SettingsError, check_listen_address, parse_endpoint
from foundation.settings import Settings
from foundation.startup import StartupError
from foundation.tls import NOT_BEFORE_MARGIN, CertificateProblem, ReloadedKeyPair, agent_ca_bundle_file
from processes.heartbeat_connections import ConnectionGuard
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2

log = logging.getLogger("shepherd.heartbeat")

SERVICE = "shepherd.agent.v1.AgentCallback"

# A HeartbeatRequest is about 150 bytes; anything far larger is not one.
MAX_REQUEST_SIZE = 1024

# Keepalive: an agent's machine that is rebooted or cut off never closes its connection, and its stream would
# stay open (and count against MAX_STREAMS) for ever; the server pings a connection quiet for this long and
# drops it when no answer comes within KEEPALIVE_TIMEOUT_MS. Two minutes (four heartbeat intervals) drops a dead
# machine's stream well before the cap could fill with them, and at 100,000 connections is under 1,000 pings a
# second, which gRPC's core answers without Python.
KEEPALIVE_TIME_MS = 120_000

KEEPALIVE_TIMEOUT_MS = 20_000

# A connection that has not finished its TLS handshake this long after it was accepted is closed (gRPC's own
# default is 2 minutes): the agent gives up on a handshake after its connect timeout of 10 s anyway, and a
# connection that never starts one is an open file held by no one who could heartbeat.
HANDSHAKE_TIMEOUT = 10.0

# How often serve_in_processes looks at its processes, and how long each may take to stop.
PROCESS_POLL = 1.0

PROCESS_STOP_TIMEOUT = 15.0


class ServingCertificate:
    """The heartbeat server's certificate chain and key (foundation.tls.ReloadedKeyPair), as gRPC serves them.

    gRPC calls fetch before every TLS handshake, so each new connection gets the pair now on disk and the
    connections already open keep theirs: renewing the files needs no restart and refuses no agent. Each process of
    --processes N holds its own and reloads on its own. With trust, a pair the agents would refuse (another name,
    another CA) is not served: at start a SettingsError, later the pair before serves on and on_refused hears of it.
    """

    def __init__(
        self,
        certificate_path: Path,
        key_path: Path,
        *,
        on_change: Callable[[], None] = lambda: None,
        not_before_margin: float = NOT_BEFORE_MARGIN,
        trust: AgentTrust | None = None,
        on_refused: Callable[[CertificateProblem], None] = lambda problem: None,
    ) -> None:
        self.on_change = on_change
        try:
            self.pair = ReloadedKeyPair(
                certificate_path,
                key_path,
                what="heartbeat server certificate",
                not_before_margin=not_before_margin,
                check=trust.check if trust is not None else lambda chain, where: None,
                on_refused=on_refused,
            )
        except CertificateProblem as problem:
            setting = "heartbeat_tls_key_path" if problem.where == str(key_path) else "heartbeat_tls_certificate_path"
            raise SettingsError(setting, str(problem)) from None
        self._configuration = _configuration_of(self.pair.pems)
        self._handed_out = self._configuration
        # fetch runs on a thread of gRPC's core, current on the event loop.
        self._lock = threading.Lock()

    def credentials(self) -> grpc.ServerCredentials:
        """The gRPC server credentials that serve this pair and call fetch before every handshake."""
        return grpc.dynamic_ssl_server_credentials(self._configuration, self.fetch)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate configuration fetcher: the pair to serve from this handshake on, None for no change."""
        try:
            with self._lock:
                self._take_a_new_pair()
                if self._configuration is self._handed_out:
                    return None
                self._handed_out = self._configuration
                return self._configuration
        except Exception:  # gRPC's core would log it at every handshake without the why; the pair before serves on
            log.exception("could not look at the heartbeat server's certificate and key for a change")
            return None

    def current(self) -> list[x509.Certificate]:
        """The chain served from the next handshake on, the files looked at first: the expiry gauge follows a
        rotation even while no agent connects."""
        with self._lock:
            self._take_a_new_pair()
            return self.pair.chain

    def _take_a_new_pair(self) -> None:
        if self.pair.look():
            self._configuration = _configuration_of(self.pair.pems)
            self.on_change()


def _configuration_of(pems: tuple[bytes, bytes]) -> grpc.ServerCertificateConfiguration:
    certificate, key = pems
    return grpc.ssl_server_certificate_configuration([(key, certificate)])


def build_server(
    service: HeartbeatService,
    listen: str,
    tls: ServingCertificate | tuple[Path, Path] | None,
    *,
    maximum_concurrent_rpcs: int | None = None,
    share_port: bool = False,
    max_connections: int = Settings.heartbeat_max_connections,
    idle_timeout: float = Settings.heartbeat_idle_timeout,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
) -> tuple[grpc.aio.Server, int]:
    """The gRPC server and the port it bound; tls is the ServingCertificate, or its (certificate chain, private
    key) PEM files.

    maximum_concurrent_rpcs is gRPC's own cap on calls open at once, unary calls and streams together, above
    which gRPC answers RESOURCE_EXHAUSTED before the service sees the call: by default the service's streams and
    heartbeats in flight, so the service's own, finer caps are the ones that act. share_port binds with
    SO_REUSEPORT, for several processes of ours on one port (serve_in_processes).

    gRPC's core closes a connection past max_connections as it is accepted, one with no call open for idle_timeout
    seconds (after a GOAWAY, which the agent reconnects on), and one without its TLS handshake done in
    handshake_timeout; a connection holding a stream is never idle, however long between its heartbeats.
    """
    if maximum_concurrent_rpcs is None:
        maximum_concurrent_rpcs = service.max_streams + service.max_in_flight
    server = grpc.aio.server(
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_SIZE),
            # gRPC binds with SO_REUSEPORT by default: a second server on the same port would then start
            # silently and take half the agents' connections, and "cannot listen" would never be said.
            ("grpc.so_reuseport", 1 if share_port else 0),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # A dead peer sends no data: the server's pings must not wait for data between them to go on.
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.max_connection_idle_ms", int(idle_timeout * 1000)),
            ("grpc.server_handshake_timeout_ms", int(handshake_timeout * 1000)),
        ],
    )
    # Requests are parsed by the service, so malformed bytes get INVALID_ARGUMENT (MALFORMED), not a generic error.
    unary = grpc.unary_unary_rpc_method_handler(
        service.handle, request_deserializer=None, response_serializer=agent_api_pb2.HeartbeatResponse.SerializeToString
    )
    # The service serializes a stream's answers itself: an accepted one is the same bytes every time.
    stream = grpc.stream_stream_rpc_method_handler(service.stream, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Heartbeat": unary, "Heartbeats": stream}),)
    )
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            serving = tls if isinstance(tls, ServingCertificate) else ServingCertificate(*tls)
            port = server.add_secure_port(listen, serving.credentials())
    except RuntimeError:
        # grpcio raises this, with no reason, where older versions returned port 0.
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the port is taken, or the address is not this host's")
    return server, port


def agent_trust(settings: Settings) -> AgentTrust:
    """What the agents check of the server's certificate, as far as this process's settings say: the host of
    agent_endpoint and the CA bundle of agent_endpoint_ca_certificate_path, each when set."""
    host = None
    if settings.agent_endpoint:
        try:
            host, _ = parse_endpoint(settings.agent_endpoint)
        except ValueError as error:
            raise SettingsError("agent_endpoint", str(error)) from None
        # An IPv6 endpoint is written [address]:port.
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    bundle = None
    if settings.agent_endpoint_ca_certificate_path is not None:
        bundle = agent_ca_bundle_file(settings.agent_endpoint_ca_certificate_path).current
    return AgentTrust(host, bundle)


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one, and return it. An agent holds a connection, and a
    connection is a file: systemd starts a service with a soft limit of 1,024, past which gRPC's core stops
    accepting connections with no more than "File descriptor limit reached" in its log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as error:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, hard, error)
    return soft


async def run_heartbeat_server(
    settings: Settings, database_url: str, *, stop: asyncio.Event | None = None, share_port: bool = False
) -> None:
    """Serve heartbeats until SIGTERM/SIGINT (or stop is set)."""
    open_files = raise_open_files_limit()
    runtime = metrics_runtime(settings.metrics_listen, "heartbeat-server")
    expiry = CertificateExpiry(meter_of(runtime))
    loop = asyncio.get_running_loop()
    tls = None
    if not settings.heartbeat_plaintext:
        assert settings.heartbeat_tls_certificate_path and settings.heartbeat_tls_key_path

        def reloaded() -> None:
            # Called on a thread of gRPC's core too; the gauge is set on the event loop.
            loop.call_soon_threadsafe(expiry.refresh)

        refused = meter_of(runtime).create_counter(
            "shepherd_heartbeat_certificate_reloads_refused_total",
            "New heartbeat server certificates not served (unusable, or refused by the agents' checks); the one "
            "before serves on",
        )

        def refuse(problem: CertificateProblem) -> None:
            loop.call_soon_threadsafe(refused.add, 1)

        tls = ServingCertificate(
            settings.heartbeat_tls_certificate_path,
            settings.heartbeat_tls_key_path,
            on_change=reloaded,
            trust=agent_trust(settings),
            on_refused=refuse,
        )
        expiry.watch(HEARTBEAT_SERVER_CERTIFICATE, tls.current)
    expiry.watch_bmdb_client(database_url)
    setting = "heartbeat_database_url" if settings.heartbeat_database_url else "database_url"
    log_bmdb_tls_warnings(log, {setting: database_url})
    bmdb = await open_bmdb(database_url, setting=setting)
    service = HeartbeatService(
        bmdb,
        interval=settings.heartbeat_interval,
        max_skew=settings.heartbeat_max_skew,
        meter=meter_of(runtime),
        # One address sending more than a whole 100,000-machine fleet is a flood; behind a proxy every agent
        # shares the proxy's address, which the default leaves room for.
        peer_rate=settings.heartbeat_peer_rate,
        peer_burst=2 * settings.heartbeat_peer_rate,
        max_streams=settings.heartbeat_max_streams,
        # Keyed by address as peer_rate is: behind a proxy that hides the agents' addresses, 0 turns it off.
        max_streams_per_address=settings.heartbeat_max_streams_per_address,
        ipv6_prefix=settings.heartbeat_ipv6_prefix,
        key_reads_per_address=settings.heartbeat_key_reads_per_address,
        key_reads=settings.heartbeat_key_reads,
    )
    try:
        server, port = build_server(
            service,
            settings.heartbeat_listen,
            tls,
            share_port=share_port,
            max_connections=settings.heartbeat_max_connections,
            idle_timeout=settings.heartbeat_idle_timeout,
        )
    except OSError as error:
        await bmdb.close()
        raise OSError(f"{error} (setting heartbeat_listen)") from None
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        loaded = await service.load_keys()
    except SQLAlchemyError as error:
        # Serving without them only costs a BMDB read a machine, as they come; refusing to start would cost more.
        log.warning("could not load the agents' keys (%s); each is read from BMDB at its first heartbeat", error)
        loaded = 0
    await server.start()
    per_address = settings.heartbeat_max_connections_per_address
    log.info(
        "heartbeat server on %s (%s), %d agent keys loaded, open files (a connection an agent): %s; connections: at "
        "most %s, %s from one address, closed after %gs with no call open",
        settings.heartbeat_listen,
        "plain text" if tls is None else "TLS",
        loaded,
        "no limit" if open_files == resource.RLIM_INFINITY else f"at most {open_files:,}",
        f"{settings.heartbeat_max_connections:,}",
        f"{per_address:,}" if per_address else "any number",
        settings.heartbeat_idle_timeout,
    )
    # Without /metrics the files are still looked at each minute, so a bad new pair is logged even while no
    # agent connects.
    watching = asyncio.create_task(expiry.run(stop))
    guard = ConnectionGuard(
        port,
        per_address,
        ipv6_prefix=settings.heartbeat_ipv6_prefix,
        holding_streams=service.stream_peers.keys,
        most_streams_from_one_address=lambda: max(service.streams_by_address.values(), default=0),
        meter=meter_of(runtime),
    )
    guarding = asyncio.create_task(guard.run(stop))
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        watching.cancel()
        guarding.cancel()
        service.end_streams()
        await server.stop(grace=5)
        await service.close()
        await bmdb.close()
        log.info("heartbeat server stopped; requests by result: %s", dict(service.results))


class HeartbeatProcessStopped(Exception):
    """One of several heartbeat server processes stopped on its own; the others were stopped too."""


def serve_in_processes(settings: Settings, database_url: str, processes: int, *, verbose: bool = False) -> None:
    """Serve heartbeats from several processes on one port until SIGTERM/SIGINT; the kernel spreads the agents'
    connections over them (SO_REUSEPORT). Process i serves /metrics on metrics_listen's port + i.

    Raises OSError when the port is taken (by anything but these processes), and HeartbeatProcessStopped when one
    of them stops on its own (its log says why).
    """
    _check_port_free(settings.heartbeat_listen)
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(
            target=_serve_one,
            args=(_settings_of_process(settings, number), database_url, verbose),
            name=f"heartbeat-server-{number}",
        )
        for number in range(processes)
    ]
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        for child in children:
            child.start()
        log.info("heartbeat server: %d processes share %s", processes, settings.heartbeat_listen)
        while not stop.is_set():
            multiprocessing.connection.wait([child.sentinel for child in children], timeout=PROCESS_POLL)
            stopped = [child for child in children if child.exitcode is not None]
            if stopped and not stop.is_set():
                raise HeartbeatProcessStopped(
                    f"heartbeat server process {stopped[0].name} stopped with status {stopped[0].exitcode}"
                    " (its log says why); the others were stopped too"
                )
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()  # SIGTERM: each stops its server gracefully
        for child in children:
            child.join(PROCESS_STOP_TIMEOUT)
            if child.is_alive():
                child.kill()
                child.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _settings_of_process(settings: Settings, number: int) -> Settings:
    if not settings.metrics_listen:
        return settings
    host, port = check_listen_address("metrics_listen", settings.metrics_listen)
    return dataclasses.replace(settings, metrics_listen=f"{host}:{port + number}")


def _serve_one(settings: Settings, database_url: str, verbose: bool) -> None:
    """One of serve_in_processes' processes (started fresh, so it sets up its own logging)."""
    configure_logging(settings.log_format, verbose=verbose)
    try:
        asyncio.run(run_heartbeat_server(settings, database_url, share_port=True))
    except (OSError, SQLAlchemyError, StartupError, SettingsError) as error:
        log.error("heartbeat server process %s cannot serve: %s", multiprocessing.current_process().name, error)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches every process of the group; the server stopped on it


def _check_port_free(listen: str) -> None:
    """Refuse a port something listens on already: sharing it (SO_REUSEPORT) would not tell."""
    host, port = check_listen_address("heartbeat_listen", listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen} from several processes: they need one fixed port")
    family, kind, protocol, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, protocol) as probe:
        # As gRPC binds: connections of a server stopped a moment ago do not count as taking the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            raise OSError(f"cannot listen on {listen}: the port is taken, or the address is not this host's") from None
