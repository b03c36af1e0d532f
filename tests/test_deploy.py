"""The files in deploy/ agree with the code: settings, commands, ports and search attributes, and the certificates
and keys each process reads reach it.

Nothing here is run: the files are parsed and every setting, command line and port they name is checked against
Shepherd's own settings and argument parser, so a renamed setting or flag fails here instead of in a deployment.
Where systemd-analyze is installed, it checks the systemd units as systemd would load them.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from foundation.setting_values import SettingsError, parse_duration
from foundation.settings import Settings
from foundation.settings_report import describe
from foundation.settings_sources import _NON_SETTING_VARIABLES
from shepherd.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
IMAGE = "shepherd"
# What the workflows set, written out here rather than imported, so a change in the code must be matched here.
SEARCH_ATTRIBUTES = {"MachineStage", "Provider", "ProviderId", "MachineId"}
SEARCH_ATTRIBUTE_TYPE = "Keyword"
DEFAULT_HEARTBEAT_LISTEN = "0.0.0.0:8900"
# The files each command reads or keeps (Settings attributes); the worker's SSH key must outlive the container.
PATHS_USED = {
    "worker": ("agent_executable_path", "agent_endpoint_ca_certificate_path", "effective_ssh_key_path"),
    "heartbeat-server": ("heartbeat_tls_certificate_path", "heartbeat_tls_key_path"),
    "api": (
        "api_signing_key_path",
        "api_policy_path",
        "api_tls_certificate_path",
        "api_tls_key_path",
        "api_client_ca_path",
    ),
}
# The operator API's listen address when none is set, and the policy file the examples stand for here, where the
# deploy files' own path does not exist (check() reads it).
DEFAULT_API_LISTEN = "127.0.0.1:8700"
EXAMPLE_POLICY = DEPLOY / "policy.example.toml"
# Kubernetes' default terminationGracePeriodSeconds.
DEFAULT_KUBERNETES_GRACE = 30.0

VARIABLE_RE = re.compile(r"\bSHEPHERD_[A-Z0-9_]+\*?")
ASSIGNMENT_RE = re.compile(r"^(SHEPHERD_[A-Z0-9_]+)=(.*)$")
CODE_BLOCK_RE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def deploy_files() -> list[Path]:
    return sorted(path for path in DEPLOY.rglob("*") if path.is_file())


def yaml_files() -> list[Path]:
    return [path for path in deploy_files() if path.suffix in (".yml", ".yaml")]


def yaml_documents(path: Path) -> list[Any]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document is not None]


def kubernetes_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, document)
        for path in yaml_files()
        if path.parent.name == "kubernetes"
        for document in yaml_documents(path)
        if "apiVersion" in document and document.get("kind") != "Kustomization"
    ]


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as systemd's EnvironmentFile= reads them (systemd.exec(5)), and Compose's env_file alike."""
    variables = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, sep, value = line.partition("=")
            assert sep, f"{rel(path)}: {line!r} is not KEY=VALUE"
            variables[key.strip()] = env_file_value(value, f"{rel(path)}: {line!r}")
    return variables


def env_file_value(text: str, where: str) -> str:
    """One value of an environment file, as systemd reads it: '...' verbatim; "..." with the shell's escapes of
    backslash, quote, backtick and dollar (any other backslash kept with its character); unquoted, a backslash
    keeps the next character. Only what these files may use: a quoted value is one string, on one line."""
    text = text.strip()
    assert not text.endswith("\\"), f"{where}: a line continued with a backslash"
    if text.startswith("'"):
        single = re.fullmatch(r"'([^']*)'", text)
        assert single, f"{where}: not one single-quoted string"
        return single.group(1)
    if text.startswith('"'):
        double = re.fullmatch(r'"((?:[^"\\]|\\.)*)"', text)
        assert double, f"{where}: not one double-quoted string"
        return re.sub(r'\\([\\"`$])', r"\1", double.group(1))
    return re.sub(r"\\(.)", r"\1", text)


def shell_env_file(path: Path) -> dict[str, str]:
    """The variables a POSIX shell gets from `set -a; . FILE`, as an operator loads the file before a command."""

    def environment(script: str) -> dict[str, str]:
        result = subprocess.run(
            ["env", "-i", "sh", "-c", script, "sh", str(path)], capture_output=True, text=True, timeout=10
        )
        assert (result.returncode, result.stderr) == (0, ""), f"sh: {script}: {result.stderr}"
        return dict(item.split("=", 1) for item in result.stdout.split("\0") if item)

    before, after = environment("env -0"), environment('set -a; . "$1"; env -0')
    return {name: value for name, value in after.items() if before.get(name) != value}


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script: each one's words, split at operators, comments dropped."""
    lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS or "\n" in token:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def script_lines(script: str) -> list[list[str]]:
    """Like shell_commands, but line by line, so a command never runs into the next line's."""
    return [command for line in script.replace("\\\n", " ").splitlines() for command in shell_commands(line)]


def shepherd_argv(words: list[str]) -> list[str] | None:
    """The arguments given to `shepherd` by one command line, or None if it does not run shepherd."""
    while words and ASSIGNMENT_RE.match(words[0]):
        words = words[1:]
    if words and PurePosixPath(words[0]).name == IMAGE:
        return words[1:]
    # kubectl exec POD -- shepherd ...
    if "--" in words:
        rest = words[words.index("--") + 1 :]
        if rest and PurePosixPath(rest[0]).name == IMAGE:
            return rest[1:]
    return None


def assignment(word: str) -> tuple[str, str]:
    name, _, value = word.partition("=")
    return name, value


def readme_blocks(path: Path) -> list[str]:
    return CODE_BLOCK_RE.findall(path.read_text())


def is_shepherd_image(image: str | None) -> bool:
    return image is not None and image.rsplit("/", 1)[-1].split(":")[0] == IMAGE


def port_of(address: str) -> int | None:
    """The port of host:port; None for a malformed address, which the settings check reports."""
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else None


@dataclass
class Dockerfile:
    env: dict[str, str]
    entrypoint: list[str]
    # Paths the image itself provides, so settings may point there without a mount.
    paths: list[str]
    # USER of the final stage, as written: "uid" or "uid:gid".
    user: str = ""


def dockerfile() -> Dockerfile:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    final_stage = text.split("\nFROM ")[-1]
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    paths: list[str] = []
    user = ""
    for line in final_stage.splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "ENV":
            env.update(assignment(word) for word in shlex.split(rest))
        elif instruction == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif instruction == "USER":
            user = rest.strip()
    paths += re.findall(r"-m agent\.build (\S+)", text)
    return Dockerfile(env, entrypoint, paths, user)


@dataclass
class Process:
    """One shepherd process a deploy file starts, as that file declares it."""

    where: str
    argv: list[str]
    env: dict[str, str]
    # Declared container ports; None on a plain host, where nothing declares them.
    ports: set[int] | None = None
    mounts: list[str] = field(default_factory=list)
    stop_grace: float | None = None
    # Kubernetes: mount path -> the Secret mounted there, and its files (name -> key) when only some are.
    secret_mounts: dict[str, tuple[str, dict[str, str] | None]] = field(default_factory=dict)

    @property
    def command(self) -> str:
        return self.argv[0] if self.argv else ""


def compose_processes() -> list[Process]:
    path = DEPLOY / "docker-compose.yml"
    (compose,) = yaml_documents(path)
    image = dockerfile()
    processes = []
    for name, service in compose["services"].items():
        if not is_shepherd_image(service.get("image")):
            continue
        where = f"{rel(path)} service {name}"
        assert "entrypoint" not in service, f"{where}: overrides the image's entrypoint"
        command = service.get("command", [])
        argv = shlex.split(command) if isinstance(command, str) else [str(word) for word in command]
        env = dict(image.env)
        env_files = service.get("env_file", [])
        for entry in [env_files] if isinstance(env_files, str | dict) else env_files:
            env.update(env_file(path.parent / (entry["path"] if isinstance(entry, dict) else entry)))
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        env.update({key: str(value) for key, value in environment.items()})
        ports = {int(str(port).rpartition(":")[2].split("/")[0]) for port in service.get("expose", [])}
        for port in service.get("ports", []):
            ports.add(
                int(port["target"]) if isinstance(port, dict) else int(str(port).rpartition(":")[2].split("/")[0])
            )
        mounts = [
            volume.split(":")[1] if isinstance(volume, str) else volume["target"]
            for volume in service.get("volumes", [])
        ]
        # Compose's default stop_grace_period.
        grace = parse_duration(str(service.get("stop_grace_period", "10s")))
        processes.append(Process(where, argv, env, ports, mounts + image.paths, grace))
    return processes


def kubernetes_env_sources() -> dict[tuple[str, str], tuple[Path, dict[str, str]]]:
    """(kind, name) -> (file, data) of every ConfigMap and Secret in deploy/kubernetes."""
    sources = {}
    for path, document in kubernetes_objects():
        if document["kind"] == "ConfigMap":
            data = {key: str(value) for key, value in document.get("data", {}).items()}
        elif document["kind"] == "Secret":
            data = {key: base64.b64decode(value).decode() for key, value in document.get("data", {}).items()}
            data.update({key: str(value) for key, value in document.get("stringData", {}).items()})
        else:
            continue
        sources[document["kind"], document["metadata"]["name"]] = (path, data)
    return sources


def pod_specs() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod template metadata, pod spec) of every workload."""
    specs = []
    for path, document in kubernetes_objects():
        template = document.get("spec", {}).get("template")
        if template is not None:
            where = f"{rel(path)} {document['kind']} {document['metadata']['name']}"
            specs.append((where, template.get("metadata", {}), template["spec"]))
    return specs


def kubernetes_processes() -> list[Process]:
    sources = kubernetes_env_sources()
    image = dockerfile()
    processes = []
    for where, _, spec in pod_specs():
        grace = float(spec.get("terminationGracePeriodSeconds", DEFAULT_KUBERNETES_GRACE))
        for container in spec.get("initContainers", []) + spec["containers"]:
            if not is_shepherd_image(container.get("image")):
                continue
            container_where = f"{where} container {container['name']}"
            command = container.get("command")
            if command is None:
                argv = [str(word) for word in image.entrypoint[1:] + container.get("args", [])]
            elif PurePosixPath(command[0]).name == IMAGE:
                argv = [str(word) for word in command[1:] + container.get("args", [])]
            else:
                continue  # the image used for another tool (an init container's install)
            env = dict(image.env)
            for source in container.get("envFrom", []):
                for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if key in source:
                        name = source[key]["name"]
                        assert (kind, name) in sources, f"{container_where}: no {kind} {name} in deploy/kubernetes"
                        env.update(sources[kind, name][1])
            env.update({item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item})
            ports = {int(port["containerPort"]) for port in container.get("ports", [])}
            mounts = [mount["mountPath"] for mount in container.get("volumeMounts", [])]
            secrets = secret_volumes(spec)
            secret_mounts = {
                mount["mountPath"]: secrets[mount["name"]]
                for mount in container.get("volumeMounts", [])
                if mount["name"] in secrets
            }
            processes.append(
                Process(container_where, argv, env, ports, mounts + image.paths, grace, secret_mounts=secret_mounts)
            )
    return processes


def secret_volumes(spec: dict[str, Any]) -> dict[str, tuple[str, dict[str, str] | None]]:
    """Volume name -> (Secret, file name -> key when the volume lists its items) of a pod's Secret volumes."""
    volumes = {}
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            items = volume["secret"].get("items")
            files = None if items is None else {item["path"]: item["key"] for item in items}
            volumes[volume["name"]] = (volume["secret"]["secretName"], files)
    return volumes


@dataclass
class Unit:
    path: Path
    directives: dict[str, list[str]]


def systemd_units() -> list[Unit]:
    units = []
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        directives: dict[str, list[str]] = {}
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", ";", "[")):
                key, _, value = line.partition("=")
                directives.setdefault(key.strip(), []).append(value.strip())
        units.append(Unit(path, directives))
    return units


def unit_own_env(unit: Unit) -> dict[str, str]:
    """The variables of the unit's Environment= lines."""
    return {
        name: value
        for assignments in unit.directives.get("Environment", [])
        for name, value in map(assignment, shlex.split(assignments))
    }


def unit_env_files(unit: Unit) -> list[Path]:
    """The committed example beside the unit of each of its EnvironmentFile=."""
    examples = []
    for name in unit.directives.get("EnvironmentFile", []):
        example = unit.path.parent / (PurePosixPath(name.lstrip("-")).name + ".example")
        assert example.is_file(), f"{rel(unit.path)}: EnvironmentFile={name} has no example {rel(example)}"
        examples.append(example)
    return examples


def unit_env(unit: Unit) -> dict[str, str]:
    """The unit's environment, with each EnvironmentFile= read from its committed example."""
    env = unit_own_env(unit)
    # systemd lets EnvironmentFile= override Environment=.
    for example in unit_env_files(unit):
        env.update(env_file(example))
    return env


def unit_exec_lines(unit: Unit) -> list[list[str]]:
    return [
        shlex.split(line.lstrip("@-:+!"))
        for key in ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload")
        for line in unit.directives.get(key, [])
    ]


def systemd_processes() -> list[Process]:
    processes = []
    for unit in systemd_units():
        for line in unit.directives.get("ExecStart", []):
            argv = shepherd_argv(shlex.split(line.lstrip("@-:+!")))
            if argv is not None:
                # systemd's default TimeoutStopSec.
                grace = parse_duration(unit.directives.get("TimeoutStopSec", ["90"])[-1])
                processes.append(Process(rel(unit.path), argv, unit_env(unit), stop_grace=grace))
    return processes


def all_processes() -> list[Process]:
    return compose_processes() + kubernetes_processes() + systemd_processes()


def readme_env_blocks() -> list[tuple[str, dict[str, str]]]:
    """(where, variables) of every README code block that assigns SHEPHERD_* variables."""
    blocks = []
    for index, block in enumerate(readme_blocks(DEPLOY / "README.md"), 1):
        env = {}
        for words in script_lines(block):
            for word in words:
                if match := ASSIGNMENT_RE.match(word):
                    env[match.group(1)] = match.group(2)
        if env:
            blocks.append((f"deploy/README.md code block {index}", env))
    return blocks


def listen_port(process: Process, setting: str, default: str | None) -> int | None:
    value = process.env.get(setting, default)
    return port_of(value) if value else None


def heartbeat_address(process: Process) -> str:
    args = build_parser().parse_args(process.argv)
    return args.heartbeat_listen or process.env.get("SHEPHERD_HEARTBEAT_LISTEN", DEFAULT_HEARTBEAT_LISTEN)


# The checks


def test_the_deploy_files_are_found():
    """Guards every other test against passing on nothing."""
    commands = {(process.where.split()[0], process.command) for process in all_processes()}
    assert {
        ("deploy/docker-compose.yml", "migrate"),
        ("deploy/docker-compose.yml", "worker"),
        ("deploy/docker-compose.yml", "heartbeat-server"),
        ("deploy/kubernetes/migrate-job.yaml", "migrate"),
        ("deploy/kubernetes/worker.yaml", "worker"),
        ("deploy/kubernetes/heartbeat-server.yaml", "heartbeat-server"),
        ("deploy/systemd/shepherd-worker.service", "worker"),
        ("deploy/systemd/shepherd-heartbeat-server.service", "heartbeat-server"),
        ("deploy/systemd/shepherd-migrate.service", "migrate"),
        ("deploy/kubernetes/api.yaml", "api"),
        ("deploy/systemd/shepherd-api.service", "api"),
    } <= commands
    assert dockerfile().entrypoint == [IMAGE], "deploy/Dockerfile: the entrypoint must be the shepherd command"


def test_every_variable_is_a_setting():
    known = {name for name, _, _ in describe()} | {f"SHEPHERD_{name.upper()}" for name in _NON_SETTING_VARIABLES}
    problems = []
    for path in deploy_files():
        for name in sorted(set(VARIABLE_RE.findall(path.read_text()))):
            # A name ending in * (SHEPHERD_HEARTBEAT_*) stands for a group of settings.
            if name.endswith("*") and not any(setting.startswith(name[:-1]) for setting in known):
                problems.append(f"{rel(path)}: no setting starts with {name[:-1]}")
            elif not name.endswith("*") and name not in known:
                problems.append(f"{rel(path)}: {name} is not a Shepherd setting")
    assert not problems, "\n".join(problems)


def shepherd_command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv) of every shepherd command line in deploy/."""
    lines = [(process.where, process.argv) for process in compose_processes() + kubernetes_processes()]
    for unit in systemd_units():
        for words in unit_exec_lines(unit):
            argv = shepherd_argv(words)
            if argv is not None:
                lines.append((rel(unit.path), argv))
    for path in DEPLOY.rglob("README*.md"):
        for block in readme_blocks(path):
            for words in script_lines(block):
                argv = shepherd_argv(words)
                if argv is not None:
                    lines.append((rel(path), argv))
    return lines


def test_every_shepherd_command_parses(capsys: pytest.CaptureFixture[str]):
    parser = build_parser()
    problems = []
    for where, argv in shepherd_command_lines():
        try:
            parser.parse_args(argv)
        except SystemExit:
            error = capsys.readouterr().err.strip().splitlines()
            problems.append(f"{where}: `shepherd {shlex.join(argv)}` is refused: {error[-1] if error else ''}")
    assert not problems, "\n".join(problems)


def test_every_setting_value_is_accepted():
    units = [(process.where, process.env) for process in all_processes()] + readme_env_blocks()
    units += [(rel(path), env_file(path)) for path in deploy_files() if path.name.endswith((".env", ".env.example"))]
    units += [(f"{rel(path)} {kind} {name}", data) for (kind, name), (path, data) in kubernetes_env_sources().items()]
    problems = []
    for where, env in units:
        try:
            # Paths point into a container or host, not here: check() is what holds for every process.
            if "SHEPHERD_API_POLICY_PATH" in env:
                env = env | {"SHEPHERD_API_POLICY_PATH": str(EXAMPLE_POLICY)}
            Settings.from_env(env).check()
        except SettingsError as error:
            problems.append(f"{where}: {error}")
    assert not problems, "\n".join(problems)


def test_path_settings_point_into_the_container():
    """The files a container reads or keeps lie in a volume it mounts, or in the image."""
    problems = []
    for process in compose_processes() + kubernetes_processes():
        settings = Settings.from_env(process.env)
        for name in PATHS_USED.get(process.command, ()):
            value = getattr(settings, name)
            if value is not None and not any(value.is_relative_to(mount) for mount in process.mounts):
                problems.append(f"{process.where}: {name} {value} is in no volume it mounts, nor in the image")
    assert not problems, "\n".join(problems)


def test_listen_ports_are_declared():
    problems = []
    for process in compose_processes() + kubernetes_processes():
        assert process.ports is not None
        wanted = {"SHEPHERD_METRICS_LISTEN": listen_port(process, "SHEPHERD_METRICS_LISTEN", None)}
        if process.command == "heartbeat-server":
            wanted["SHEPHERD_HEARTBEAT_LISTEN"] = port_of(heartbeat_address(process))
        if process.command == "api":
            wanted["SHEPHERD_API_LISTEN"] = listen_port(process, "SHEPHERD_API_LISTEN", DEFAULT_API_LISTEN)
        for setting, port in wanted.items():
            if port is not None and port not in process.ports:
                problems.append(
                    f"{process.where}: {setting} port {port} is not among its declared ports {sorted(process.ports)}"
                )
    assert not problems, "\n".join(problems)


def test_systemd_units_on_one_host_use_different_ports():
    taken: dict[int, str] = {}
    problems = []
    for process in systemd_processes():
        ports = {listen_port(process, "SHEPHERD_METRICS_LISTEN", None)}
        if process.command == "heartbeat-server":
            ports.add(port_of(heartbeat_address(process)))
        if process.command == "api":
            ports.add(listen_port(process, "SHEPHERD_API_LISTEN", DEFAULT_API_LISTEN))
        for port in ports - {None}:
            assert port is not None
            if port in taken:
                problems.append(f"{process.where}: port {port} is also taken by {taken[port]}")
            taken[port] = process.where
    assert not problems, "\n".join(problems)


def test_prometheus_annotations_name_the_metrics_port():
    processes = {process.where.rsplit(" container ", 1)[0]: process for process in kubernetes_processes()}
    problems = []
    for where, metadata, _ in pod_specs():
        annotations = metadata.get("annotations", {})
        if "prometheus.io/port" not in annotations or where not in processes:
            continue
        metrics = listen_port(processes[where], "SHEPHERD_METRICS_LISTEN", None)
        if str(metrics) != annotations["prometheus.io/port"]:
            problems.append(f"{where}: prometheus.io/port {annotations['prometheus.io/port']} but metrics on {metrics}")
    assert not problems, "\n".join(problems)


def test_service_target_ports_exist():
    pods = pod_specs()
    problems = []
    for path, document in kubernetes_objects():
        if document["kind"] != "Service":
            continue
        where = f"{rel(path)} Service {document['metadata']['name']}"
        selector = document["spec"]["selector"]
        selected = [spec for _, metadata, spec in pods if selector.items() <= metadata.get("labels", {}).items()]
        if not selected:
            problems.append(f"{where}: its selector {selector} selects no pod in deploy/kubernetes")
        for port in document["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for spec in selected:
                declared = [item for container in spec["containers"] for item in container.get("ports", [])]
                if not any(target in (item["containerPort"], item.get("name")) for item in declared):
                    problems.append(f"{where}: targetPort {target} is no containerPort of the pods it selects")
    assert not problems, "\n".join(problems)


def test_the_heartbeat_service_publishes_the_heartbeat_port_alone():
    """The heartbeat Service is what the machines are shown: it carries the heartbeat port and nothing else, and
    the metrics port has a Service of its own, inside the cluster alone."""
    services = [
        (f"{rel(path)} Service {document['metadata']['name']}", document["spec"])
        for path, document in kubernetes_objects()
        if document["kind"] == "Service"
    ]
    heartbeat = [(where, spec) for where, spec in services if any(p["port"] == 8900 for p in spec["ports"])]
    metrics = [(where, spec) for where, spec in services if any(p.get("name") == "metrics" for p in spec["ports"])]
    assert heartbeat and metrics, services
    problems = [
        f"{where}: publishes {[port.get('name', port['port']) for port in spec['ports']]} beside the heartbeats"
        for where, spec in heartbeat
        if len(spec["ports"]) != 1
    ]
    problems += [
        f"{where}: a metrics Service of type {spec.get('type')}, not ClusterIP"
        for where, spec in metrics
        if spec.get("type", "ClusterIP") != "ClusterIP"
    ]
    assert any(spec["selector"].get("app.kubernetes.io/component") == "heartbeat-server" for _, spec in metrics), (
        "no Service for the heartbeat server's metrics"
    )
    assert not problems, "\n".join(problems)


def test_workers_stop_within_their_grace():
    problems = []
    for process in all_processes():
        if process.command != "worker":
            continue
        shutdown_grace = Settings.from_env(process.env).shutdown_grace
        if process.stop_grace is None or process.stop_grace <= shutdown_grace:
            problems.append(
                f"{process.where}: killed after {process.stop_grace}s, "
                f"not above SHEPHERD_SHUTDOWN_GRACE ({shutdown_grace}s) for running activities to finish"
            )
    assert not problems, "\n".join(problems)


def test_search_attributes_are_registered():
    registrations: dict[Path, dict[str, list[str]]] = {}
    for path in deploy_files():
        # A README's prose need not be valid shell, only its code blocks.
        text = "\n".join(readme_blocks(path)) if path.suffix == ".md" else path.read_text()
        lines = [line for line in text.replace("\\\n", " ").splitlines() if "search-attribute" in line]
        for words in (words for line in lines for words in shell_commands(line)):
            if "search-attribute" not in words or "create" not in words:
                continue
            names = [value for option, value in itertools.pairwise(words) if option == "--name"]
            types = [value for option, value in itertools.pairwise(words) if option == "--type"]
            assert len(names) == len(types), f"{rel(path)}: {shlex.join(words)} gives no type to each name"
            for name, kind in zip(names, types, strict=True):
                registrations.setdefault(path, {}).setdefault(name, []).append(kind)
    assert registrations, "no `temporal operator search-attribute create` in deploy/"
    problems = []
    for path, registered in registrations.items():
        if set(registered) != SEARCH_ATTRIBUTES:
            problems.append(
                f"{rel(path)}: registers {sorted(registered)}, not the search attributes {sorted(SEARCH_ATTRIBUTES)}"
            )
        for name, kinds in registered.items():
            if set(kinds) != {SEARCH_ATTRIBUTE_TYPE}:
                problems.append(f"{rel(path)}: {name} registered as {', '.join(kinds)}, not {SEARCH_ATTRIBUTE_TYPE}")
    assert not problems, "\n".join(problems)


def test_kustomization_lists_the_manifests():
    (kustomization,) = yaml_documents(DEPLOY / "kubernetes" / "kustomization.yaml")
    manifests = {
        path.name
        for path in yaml_files()
        if path.parent.name == "kubernetes" and path.name != "kustomization.yaml" and ".example." not in path.name
    }
    listed = set(kustomization["resources"])
    assert listed == manifests, (
        f"deploy/kubernetes/kustomization.yaml: resources lack {sorted(manifests - listed)}, "
        f"name missing files {sorted(listed - manifests)}"
    )


def test_yaml_files_parse():
    for path in yaml_files():
        assert yaml_documents(path), f"{rel(path)} holds no YAML document"


# Certificates and keys

# The variables that name a certificate, key or configuration file a process reads, beside the database URL's.
FILE_VARIABLES = (
    "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_CONFIG_FILE",
    "SHEPHERD_HEARTBEAT_TLS_CERTIFICATE_PATH",
    "SHEPHERD_HEARTBEAT_TLS_KEY_PATH",
    "SHEPHERD_AGENT_ENDPOINT_CA_CERTIFICATE_PATH",
    "SHEPHERD_API_TLS_CERTIFICATE_PATH",
    "SHEPHERD_API_TLS_KEY_PATH",
    "SHEPHERD_API_CLIENT_CA_PATH",
)
# libpq's parameters in a BMDB URL that name files.
DATABASE_URL_FILES = ("sslrootcert", "sslcert", "sslkey")
# The BMDB URLs: the workers' and the migration's, and the heartbeat server's own.
DATABASE_URL_VARIABLES = ("SHEPHERD_DATABASE_URL", "SHEPHERD_HEARTBEAT_DATABASE_URL")
# Which of those each command reads: the worker's include what operator commands, run beside it, read.
FILES_READ = {
    "worker": ("TEMPORAL_", "SHEPHERD_AGENT_ENDPOINT_CA_", "SHEPHERD_DATABASE_URL"),
    "heartbeat-server": ("SHEPHERD_HEARTBEAT_TLS_", "SHEPHERD_DATABASE_URL", "SHEPHERD_HEARTBEAT_DATABASE_URL"),
    "migrate": ("SHEPHERD_DATABASE_URL",),
    "api": ("TEMPORAL_", "SHEPHERD_API_", "SHEPHERD_DATABASE_URL"),
}
# What lets a process authenticate to Temporal: only the workers and the operator API talk to Temporal.
TEMPORAL_CREDENTIALS = (
    "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_CLIENT_KEY_DATA",
    "TEMPORAL_API_KEY",
    "TEMPORAL_CONFIG_FILE",
)
# The processes that talk to Temporal, each with a credential of its own.
TEMPORAL_HOLDERS = ("worker", "api")
# Shepherd's own Temporal settings, which win over the Temporal CLI's configuration.
SHEPHERDS_TEMPORAL_SETTINGS = ("temporal_address", "temporal_namespace")
# libpq refuses a key file owned by root that its group may write or run, or others may use at all; a mounted
# Secret's files are root's. (With an fsGroup, Kubernetes adds group read to them: 0400 becomes 0440.)
FORBIDDEN_SECRET_MODE_BITS = stat.S_IWGRP | stat.S_IXGRP | stat.S_IRWXO
# Kubernetes' default mode of a Secret volume's files, when neither defaultMode nor an item's mode is set.
DEFAULT_SECRET_MODE = 0o644
CREDENTIAL_SPECIFIER_RE = re.compile(r"(?:%d|\$\{?CREDENTIALS_DIRECTORY\}?)/([^\s/\"']+)")


def files_named(env: dict[str, str]) -> list[tuple[str, str]]:
    """(setting, path) of every certificate, key or configuration file the environment names."""
    files = [(name, env[name]) for name in FILE_VARIABLES if env.get(name)]
    for variable in DATABASE_URL_VARIABLES:
        if url := env.get(variable):
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
            for parameter in DATABASE_URL_FILES:
                files += [(f"{variable} {parameter}", value) for value in query.get(parameter, [])]
    return files


def files_read(process: Process) -> list[tuple[str, str]]:
    prefixes = FILES_READ.get(process.command, ())
    return [(setting, path) for setting, path in files_named(process.env) if setting.startswith(prefixes)]


@dataclass
class SecretDefinition:
    where: str
    keys: set[str]


def readme_secrets() -> list[tuple[str, SecretDefinition]]:
    """(name, definition) of every `kubectl create secret` in deploy/README.md."""
    found = []
    for block in readme_blocks(DEPLOY / "README.md"):
        for words in script_lines(block):
            if words[:3] != ["kubectl", "create", "secret"] or len(words) < 5:
                continue
            kind, name = words[3], words[4]
            keys = {"tls.crt", "tls.key"} if kind == "tls" else set()
            # --from-file=KEY=PATH, --from-file=PATH (the key is its file name), and the same with a space.
            options = [word for option in words[5:] for word in option.split("=", 1)]
            for option, value in itertools.pairwise([*options, ""]):
                if option == "--from-file":
                    key, separator, _ = value.partition("=")
                    keys.add(key if separator else PurePosixPath(value).name)
                elif option == "--from-literal":
                    keys.add(value.partition("=")[0])
            found.append((name, SecretDefinition(f"deploy/README.md `kubectl create secret {kind} {name}`", keys)))
    return found


def secret_definitions() -> dict[str, list[SecretDefinition]]:
    """Secret name -> where it is defined: deploy/kubernetes' example manifests and the README's commands."""
    definitions: dict[str, list[SecretDefinition]] = {}
    for path, document in kubernetes_objects():
        if document["kind"] == "Secret":
            keys = set(document.get("data", {})) | set(document.get("stringData", {}))
            name = document["metadata"]["name"]
            definitions.setdefault(name, []).append(SecretDefinition(f"{rel(path)} Secret {name}", keys))
    for name, definition in readme_secrets():
        definitions.setdefault(name, []).append(definition)
    return definitions


def secrets_used(spec: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(Secret, key, or None for all of it) of every use of a Secret in a pod: volumes and environment."""
    used: list[tuple[str, str | None]] = []
    for secret, files in secret_volumes(spec).values():
        used += [(secret, key) for key in files.values()] if files is not None else [(secret, None)]
    for container in spec.get("initContainers", []) + spec["containers"]:
        used += [
            (source["secretRef"]["name"], None) for source in container.get("envFrom", []) if "secretRef" in source
        ]
        for item in container.get("env", []):
            if reference := item.get("valueFrom", {}).get("secretKeyRef"):
                used.append((reference["name"], reference["key"]))
    return used


def secret_file(process: Process, path: str) -> tuple[str, str] | None:
    """(Secret, key) of the mounted Secret file at path in a Kubernetes container, or None."""
    for mount, (secret, files) in process.secret_mounts.items():
        if PurePosixPath(path).is_relative_to(mount):
            name = str(PurePosixPath(path).relative_to(mount))
            if files is None:
                return secret, name
            return (secret, files[name]) if name in files else None
    return None


def test_every_secret_a_pod_uses_is_defined_with_its_keys():
    definitions = secret_definitions()
    problems = []
    for where, _, spec in pod_specs():
        for secret, key in secrets_used(spec):
            if secret not in definitions:
                problems.append(f"{where}: Secret {secret} is neither in an example manifest nor in deploy/README.md")
                continue
            for definition in definitions[secret]:
                if key is not None and key not in definition.keys:
                    problems.append(f"{where}: key {key} of Secret {secret} is not in {definition.where}")
    assert not problems, "\n".join(problems)


def test_a_secret_defined_twice_has_the_same_keys():
    problems = [
        f"{first.where} has keys {sorted(first.keys)}, {other.where} {sorted(other.keys)}"
        for definitions in secret_definitions().values()
        for first, other in itertools.pairwise(definitions)
        if first.keys != other.keys
    ]
    assert not problems, "\n".join(problems)


def test_certificates_and_keys_lie_in_what_each_container_mounts():
    """In Kubernetes each file a container's variables name is a key of a Secret it mounts; in Compose each file
    its command reads lies in a volume it mounts (every service shares shepherd.env, whether it reads a file or
    not)."""
    definitions = secret_definitions()
    problems = []
    for process in kubernetes_processes():
        for setting, path in files_named(process.env):
            found = secret_file(process, path)
            if found is None:
                problems.append(f"{process.where}: {setting} {path} is no file of a Secret it mounts")
            elif not all(found[1] in definition.keys for definition in definitions.get(found[0], [])):
                problems.append(f"{process.where}: {setting} {path} is key {found[1]}, not in Secret {found[0]}")
    for process in compose_processes():
        for setting, path in files_read(process):
            if not any(PurePosixPath(path).is_relative_to(mount) for mount in process.mounts):
                problems.append(f"{process.where}: {setting} {path} is in no volume it mounts")
    assert not problems, "\n".join(problems)


def test_mounted_secrets_are_readable_by_the_pods_user_alone():
    """libpq refuses a client key that others may read, and a key belongs to the process it is mounted for."""
    problems = []
    for where, _, spec in pod_specs():
        volumes = {volume["name"]: volume for volume in spec.get("volumes", []) if "secret" in volume}
        if not volumes:
            continue
        security = spec.get("securityContext", {})
        # The files are root's: the non-root user reads them through the group fsGroup adds to its processes.
        if not security.get("runAsNonRoot") or security.get("fsGroup") is None:
            problems.append(f"{where}: mounts Secrets but does not run as non-root with an fsGroup")
        for name, volume in volumes.items():
            default_mode = volume["secret"].get("defaultMode", DEFAULT_SECRET_MODE)
            modes = [default_mode] + [item["mode"] for item in volume["secret"].get("items", []) if "mode" in item]
            for mode in modes:
                if mode & FORBIDDEN_SECRET_MODE_BITS:
                    problems.append(f"{where}: Secret volume {name} has mode {mode:04o}, which libpq refuses for a key")
        for container in spec.get("initContainers", []) + spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in volumes and not mount.get("readOnly"):
                    problems.append(f"{where}: container {container['name']} mounts Secret {mount['name']} writable")
    assert not problems, "\n".join(problems)


def test_only_workers_and_the_api_hold_temporal_credentials():
    """The heartbeat server and migrate never talk to Temporal; the heartbeat server is what the machines reach.
    The workers and the operator API each hold a Temporal credential of their own, never the other's."""
    problems = []
    for process in all_processes():
        held = [name for name in TEMPORAL_CREDENTIALS if process.env.get(name)]
        if process.command not in TEMPORAL_HOLDERS and held:
            problems.append(f"{process.where}: `shepherd {process.command}` is given {', '.join(held)}")
    temporal_secrets = {
        (process.command, found[0])
        for process in kubernetes_processes()
        if process.command in TEMPORAL_HOLDERS
        for setting, path in files_named(process.env)
        if setting.startswith("TEMPORAL_") and (found := secret_file(process, path))
    }
    for process in kubernetes_processes():
        others = {secret for holder, secret in temporal_secrets if holder != process.command}
        mounted = {secret for secret, _ in process.secret_mounts.values()} & others
        if mounted:
            problems.append(f"{process.where}: `shepherd {process.command}` mounts {', '.join(sorted(mounted))}")
    # The production-shaped workers and API use mutual TLS, so the checks above have something to hold.
    for process in kubernetes_processes() + systemd_processes():
        if process.command in TEMPORAL_HOLDERS and not process.env.get("TEMPORAL_TLS_CLIENT_KEY_PATH"):
            problems.append(f"{process.where}: `shepherd {process.command}` has no TEMPORAL_TLS_CLIENT_KEY_PATH")
    assert not problems, "\n".join(problems)


def test_temporal_is_found_through_the_temporal_clis_variables():
    """SHEPHERD_TEMPORAL_ADDRESS and _NAMESPACE would win over TEMPORAL_ADDRESS and the rest of the Temporal CLI's
    configuration, which the `temporal` commands of deploy/README.md read too: set here, the two would split one
    connection between two sets of variables, and `temporal` would reach another cluster than Shepherd."""
    problems = []
    shepherds = [f"SHEPHERD_{name.upper()}" for name in SHEPHERDS_TEMPORAL_SETTINGS]
    environments = [(process.where, process.env) for process in all_processes()] + readme_env_blocks()
    environments += [
        (rel(path), env_file(path)) for path in deploy_files() if path.name.endswith((".env", ".env.example"))
    ]
    environments += [
        (f"{rel(path)} {kind} {name}", data) for (kind, name), (path, data) in kubernetes_env_sources().items()
    ]
    for where, env in environments:
        problems += [f"{where}: sets {name}" for name in shepherds if name in env]
    for path in deploy_files():
        if path.suffix == ".toml":
            settings = tomllib.loads(path.read_text())
            problems += [f"{rel(path)}: sets {name}" for name in SHEPHERDS_TEMPORAL_SETTINGS if name in settings]
    for process in all_processes():
        if process.command == "worker":
            problems += [
                f"{process.where}: no {name}"
                for name in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE")
                if name not in process.env
            ]
    assert not problems, "\n".join(problems)


def unit_credentials(unit: Unit) -> dict[str, str]:
    """Credential id -> the file it is loaded from, of a unit's LoadCredential= and LoadCredentialEncrypted=."""
    credentials = {}
    for key in ("LoadCredential", "LoadCredentialEncrypted"):
        for value in unit.directives.get(key, []):
            identifier, _, source = value.partition(":")
            credentials[identifier] = source
    return credentials


def test_systemd_credentials_are_loaded_and_used():
    problems = []
    for unit in systemd_units():
        credentials = unit_credentials(unit)
        used = set()
        for key, values in unit.directives.items():
            for value in values:
                for identifier in CREDENTIAL_SPECIFIER_RE.findall(value):
                    used.add(identifier)
                    if identifier not in credentials:
                        problems.append(
                            f"{rel(unit.path)}: {key}= reads credential {identifier}, loaded by no LoadCredential="
                        )
        for identifier, source in credentials.items():
            if identifier not in used:
                problems.append(f"{rel(unit.path)}: credential {identifier} is loaded but no setting points at it")
            if not PurePosixPath(source).is_absolute():
                problems.append(f"{rel(unit.path)}: credential {identifier} is loaded from {source!r}, not a file")
        # systemd expands %d in a unit's own lines only, never in an EnvironmentFile=.
        for example in unit_env_files(unit):
            for variable, value in env_file(example).items():
                if CREDENTIAL_SPECIFIER_RE.search(value):
                    problems.append(
                        f"{rel(example)}: {variable} points into the credentials directory, never expanded there"
                    )
    assert not problems, "\n".join(problems)


def test_systemd_environment_files_do_not_override_the_units():
    """An EnvironmentFile= wins over Environment=: a variable set in both would make the unit's line dead."""
    problems = [
        f"{rel(example)}: sets {variable}, overriding {rel(unit.path)}"
        for unit in systemd_units()
        for example in unit_env_files(unit)
        for variable in sorted(set(unit_own_env(unit)) & set(env_file(example)))
    ]
    assert not problems, "\n".join(problems)


def systemd_env_files() -> list[Path]:
    return sorted({example for unit in systemd_units() for example in unit_env_files(unit)})


def test_a_shell_reads_the_systemd_environment_files_as_systemd_does(tmp_path):
    """Operators load worker.env into a shell (`set -a; . /etc/shepherd/worker.env`) to run commands beside the
    services: the shell must get what systemd gives them, the & of a TLS database URL included. The assignments
    its comments offer must hold the same once uncommented."""
    examples = systemd_env_files()
    assert examples, "no EnvironmentFile= example in deploy/systemd"
    problems = []
    for example in examples:
        uncommented = tmp_path / example.name
        uncommented.write_text(re.sub(r"^# ?(?=[A-Z][A-Z0-9_]*=)", "", example.read_text(), flags=re.MULTILINE))
        for path, where in ((example, rel(example)), (uncommented, f"{rel(example)}, uncommented")):
            systemd, shell = env_file(path), shell_env_file(path)
            if shell != systemd:
                problems.append(f"{where}: a shell reads {shell}, systemd {systemd}")
                continue
            from_shell, from_systemd = Settings.from_env(shell), Settings.from_env(systemd)
            if from_shell != from_systemd:
                problems.append(f"{where}: the settings from a shell {from_shell}, from systemd {from_systemd}")
    assert not problems, "\n".join(problems)
    # Guards the test against passing on nothing: the URL has the & that a shell would take for its own.
    assert any("&" in env_file(example).get("SHEPHERD_DATABASE_URL", "") for example in examples)


def test_systemd_loads_the_units_without_a_warning(tmp_path):
    """systemd-analyze verify reads the units as systemd does: unknown keys, bad specifiers, bad values."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # The units name the installed command; verify checks that it exists, so this checkout's stands in for it.
    here = Path(sys.executable).parent / IMAGE
    if not here.exists():
        pytest.fail(f"no {here} to stand in for the installed command: install the project in this environment")
    units = []
    for unit in systemd_units():
        copy = tmp_path / unit.path.name
        copy.write_text(unit.path.read_text().replace(f"/opt/shepherd/.venv/bin/{IMAGE}", str(here)))
        units.append(str(copy))
    result = subprocess.run([analyze, "verify", "--man=no", *units], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


# Least privilege

# Each process's BMDB credential: the migration's is BMDB's owner, the workers' a user granted shepherd_worker, the
# heartbeat server's its own URL, of a user granted shepherd_heartbeat; the operator API's a user of its own.
BMDB_CREDENTIAL = {
    "migrate": "SHEPHERD_DATABASE_URL",
    "worker": "SHEPHERD_DATABASE_URL",
    "api": "SHEPHERD_DATABASE_URL",
}
# What every way of running it all runs; the operator API where it is deployed.
REQUIRED_PROCESSES = {"heartbeat-server", "migrate", "worker"}
HEARTBEAT_CREDENTIAL = "SHEPHERD_HEARTBEAT_DATABASE_URL"
# What the heartbeat server may be handed from a Secret: its own BMDB URL; and the Secret keys it may share with
# the workers: a CA certificate, which is public.
HEARTBEAT_SECRET_KEYS = {HEARTBEAT_CREDENTIAL}
SHAREABLE_SECRET_KEYS = {"ca.crt"}
# Container securityContext fields every Shepherd container sets, as their value must be.
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True}
# Where a heartbeat server and a migration may connect to: DNS and PostgreSQL.
BMDB_ONLY_PORTS = {53, 5432}
# Where the operator API may connect to: DNS, PostgreSQL, Temporal's frontend and the OIDC issuer (https).
API_PORTS = {53, 443, 5432, 7233}
TEMPORAL_UI_IMAGE = "temporalio/ui"
# The sandbox every unit carries (systemd.exec(5)), each directive with the value it must have.
SYSTEMD_SANDBOX = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "MemoryDenyWriteExecute": "yes",
    "CapabilityBoundingSet": "",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "SystemCallArchitectures": "native",
}
SYSTEM_SERVICE_FILTER = "@system-service"
# The private temporary directory every Shepherd process needs (systemd's PrivateTmp= gives the units theirs).
TMP = "/tmp"
# `systemd-analyze security`'s overall exposure, in its tenths (0 to 100): every unit at or below 2.0 ("OK").
SYSTEMD_EXPOSURE_THRESHOLD = 20


def deployment(process: Process) -> str:
    """Which way of running it all a process belongs to: the compose file, the kustomization, the units."""
    return process.where.split()[0] if "docker-compose" in process.where else str(PurePosixPath(process.where).parent)


def bmdb_user(url: str) -> str:
    return urllib.parse.urlsplit(url).username or ""


def test_each_process_holds_its_own_bmdb_credential():
    """The workers' user cannot change a table, the heartbeat server's can only record heartbeats; only the
    migration holds the owner's."""
    problems = []
    users: dict[str, dict[str, str]] = {}
    for process in all_processes():
        if process.command == "heartbeat-server":
            if process.env.get("SHEPHERD_DATABASE_URL"):
                problems.append(f"{process.where}: the heartbeat server is given SHEPHERD_DATABASE_URL")
            url = process.env.get(HEARTBEAT_CREDENTIAL, "")
        elif process.command in BMDB_CREDENTIAL:
            if process.env.get(HEARTBEAT_CREDENTIAL):
                problems.append(f"{process.where}: `shepherd {process.command}` is given {HEARTBEAT_CREDENTIAL}")
            url = process.env.get(BMDB_CREDENTIAL[process.command], "")
        else:
            continue
        if not bmdb_user(url):
            problems.append(f"{process.where}: `shepherd {process.command}` has no BMDB user of its own")
        users.setdefault(deployment(process), {})[process.command] = bmdb_user(url)
    for where, by_command in users.items():
        if not REQUIRED_PROCESSES <= set(by_command):
            problems.append(f"{where}: runs {sorted(by_command)}, not a migration, workers and a heartbeat server")
        elif len(set(by_command.values())) != len(by_command):
            problems.append(f"{where}: processes share a BMDB user: {by_command}")
    assert not problems, "\n".join(problems)


def test_the_heartbeat_server_holds_nothing_of_the_workers():
    """The machines reach the heartbeat server: it holds neither the SSH key, nor Temporal credentials, nor the
    workers' BMDB credential, however it is run."""
    definitions = secret_definitions()

    def keys_of(secret: str, key: str | None) -> set[str]:
        if key is not None:
            return {key}
        return set().union(*(definition.keys for definition in definitions.get(secret, [])))

    problems = []
    pods = {where: spec for where, _, spec in pod_specs()}
    workers = [spec for where, spec in pods.items() if "worker" in where]
    heartbeats = [(where, spec) for where, spec in pods.items() if "heartbeat" in where]
    assert workers and heartbeats, "no worker or heartbeat server pods in deploy/kubernetes"
    workers_secrets = {
        (secret, held) for spec in workers for secret, key in secrets_used(spec) for held in keys_of(secret, key)
    }
    for where, spec in heartbeats:
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    name = source["secretRef"]["name"]
                    if not keys_of(name, None) <= HEARTBEAT_SECRET_KEYS:
                        problems.append(f"{where}: its environment Secret {name} holds {sorted(keys_of(name, None))}")
        for secret, key in secrets_used(spec):
            shared = {held for held in keys_of(secret, key) if (secret, held) in workers_secrets}
            if shared - SHAREABLE_SECRET_KEYS:
                problems.append(f"{where}: holds what the workers hold: {sorted(shared)} of Secret {secret}")
    # Compose: the workers' state volume holds the SSH key.
    for process in compose_processes():
        if process.command == "heartbeat-server":
            for worker in compose_processes():
                if worker.command == "worker":
                    shared = set(worker.mounts) & set(process.mounts) - set(dockerfile().paths)
                    if Settings.from_env(worker.env).state_dir.as_posix() in shared:
                        problems.append(f"{process.where}: mounts the workers' state, their SSH key")
    # systemd: the units' environment files and users; the user shepherd reads worker.env and the SSH key.
    units = {unit.path.name: unit for unit in systemd_units()}
    worker_unit = units["shepherd-worker.service"]
    for name, unit in units.items():
        if unit is worker_unit:
            continue
        if set(unit.directives.get("EnvironmentFile", [])) & set(worker_unit.directives.get("EnvironmentFile", [])):
            problems.append(f"deploy/systemd/{name}: reads the workers' environment file")
        if unit.directives.get("DynamicUser") != ["yes"] and unit.directives.get("User") == worker_unit.directives.get(
            "User"
        ):
            problems.append(f"deploy/systemd/{name}: runs as the workers' user, who reads their SSH key")
    assert not problems, "\n".join(problems)


def test_the_api_holds_nothing_of_the_workers():
    """Operators reach the operator API: it holds neither the SSH key, nor the workers' Temporal credential, nor
    their BMDB credential; a CA certificate is all it may share with them."""
    definitions = secret_definitions()

    def held(spec: dict[str, Any]) -> set[tuple[str, str]]:
        return {
            (secret, one)
            for secret, key in secrets_used(spec)
            for one in ({key} if key is not None else set().union(*(d.keys for d in definitions.get(secret, []))))
        }

    pods = {where: spec for where, _, spec in pod_specs()}
    workers = set().union(*(held(spec) for where, spec in pods.items() if "worker" in where))
    apis = [(where, spec) for where, spec in pods.items() if "api.yaml" in where]
    assert workers and apis, "no worker or operator API pods in deploy/kubernetes"
    problems = [
        f"{where}: holds what the workers hold: {key} of Secret {secret}"
        for where, spec in apis
        for secret, key in sorted(held(spec) & workers)
        if key not in SHAREABLE_SECRET_KEYS
    ]
    assert not problems, "\n".join(problems)


def test_every_container_runs_unprivileged_with_a_read_only_root():
    problems = []
    # The image's own user is numeric, so runAsNonRoot can check it, and the one the pods name.
    uid, _, gid = dockerfile().user.partition(":")
    if not uid.isdigit() or int(uid) == 0 or not gid.isdigit():
        problems.append(
            f"deploy/Dockerfile: USER {dockerfile().user!r} is not a numeric user and group, other than root"
        )
    for where, _, spec in pod_specs():
        pod = spec.get("securityContext", {})
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: mounts a service account token, which Shepherd never uses")
        if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
            problems.append(f"{where}: shares a namespace of the node")
        for container in spec.get("initContainers", []) + spec["containers"]:
            security = container.get("securityContext", {})
            name = f"{where} container {container['name']}"
            for key, value in CONTAINER_SECURITY.items():
                if security.get(key) is not value:
                    problems.append(f"{name}: securityContext.{key} is not {value}")
            if security.get("privileged"):
                problems.append(f"{name}: is privileged")
            capabilities = security.get("capabilities", {})
            if "ALL" not in capabilities.get("drop", []) or capabilities.get("add"):
                problems.append(f"{name}: does not drop every capability ({capabilities})")
            if not security.get("runAsNonRoot", pod.get("runAsNonRoot")):
                problems.append(f"{name}: may run as root")
            user = (security.get("runAsUser", pod.get("runAsUser")), security.get("runAsGroup", pod.get("runAsGroup")))
            if user != (int(uid or 0), int(gid or 0)):
                problems.append(f"{name}: runs as {user}, not the image's user {dockerfile().user}")
            seccomp = security.get("seccompProfile", pod.get("seccompProfile", {}))
            if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{name}: has no seccomp profile")
    path = DEPLOY / "docker-compose.yml"
    (compose,) = yaml_documents(path)
    for name, service in compose["services"].items():
        if not is_shepherd_image(service.get("image")):
            continue
        where = f"{rel(path)} service {name}"
        if service.get("read_only") is not True:
            problems.append(f"{where}: its root file system is not read_only")
        if "ALL" not in service.get("cap_drop", []) or service.get("cap_add") or service.get("privileged"):
            problems.append(f"{where}: does not drop every capability")
        if "no-new-privileges:true" not in service.get("security_opt", []):
            problems.append(f"{where}: may gain privileges (security_opt no-new-privileges:true)")
    assert not problems, "\n".join(problems)


def test_what_a_process_writes_is_a_writable_volume():
    """With the root file system read-only, every Shepherd process needs a private /tmp (asyncssh's import looks
    for a native library through ctypes, which writes a temporary file where a C compiler is installed), and the
    worker's state (its SSH key) must lie in a volume it may write: an emptyDir, a Compose volume mounted
    read-write, a unit's StateDirectory= or ReadWritePaths=."""
    problems = []
    for where, _, spec in pod_specs():
        writable = {volume["name"] for volume in spec.get("volumes", []) if "emptyDir" in volume}
        writable |= {volume["name"] for volume in spec.get("volumes", []) if "persistentVolumeClaim" in volume}
        for container in spec["containers"]:
            if is_shepherd_image(container.get("image")) and not any(
                mount["mountPath"] == TMP and mount["name"] in writable and not mount.get("readOnly")
                for mount in container.get("volumeMounts", [])
            ):
                problems.append(f"{where} container {container['name']}: no writable {TMP}")
            if container.get("args", [None])[0] != "worker":
                continue
            state = Settings.from_env(
                {item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item}
                | dockerfile().env
            ).state_dir
            mounts = [
                mount
                for mount in container.get("volumeMounts", [])
                if state.is_relative_to(mount["mountPath"]) and mount["name"] in writable and not mount.get("readOnly")
            ]
            if not mounts:
                problems.append(f"{where} container {container['name']}: its state {state} is in no writable volume")
    (compose,) = yaml_documents(DEPLOY / "docker-compose.yml")
    for name, service in compose["services"].items():
        if is_shepherd_image(service.get("image")) and TMP not in service.get("tmpfs", []):
            problems.append(f"deploy/docker-compose.yml service {name}: no tmpfs at {TMP}")
    for process in compose_processes():
        if process.command == "worker":
            state = Settings.from_env(process.env).state_dir
            (compose,) = yaml_documents(DEPLOY / "docker-compose.yml")
            volumes = [
                volume
                for service in compose["services"].values()
                if service.get("command") == "worker"
                for volume in service.get("volumes", [])
                if isinstance(volume, str) and volume.split(":")[1] == state.as_posix()
            ]
            if not volumes or any(volume.endswith(":ro") for volume in volumes):
                problems.append(f"{process.where}: its state {state} is in no volume it may write")
    for unit in systemd_units():
        for line in unit.directives.get("ExecStart", []):
            argv = shepherd_argv(shlex.split(line.lstrip("@-:+!")))
            if argv is None or argv[0] != "worker":
                continue
            state = Settings.from_env(unit_env(unit)).state_dir
            writable_paths = [
                f"/var/lib/{name}" for name in " ".join(unit.directives.get("StateDirectory", [])).split()
            ]
            writable_paths += " ".join(unit.directives.get("ReadWritePaths", [])).split()
            if not any(state.is_relative_to(path.lstrip("-")) for path in writable_paths):
                problems.append(f"{rel(unit.path)}: its state {state} is in no StateDirectory= or ReadWritePaths=")
    assert not problems, "\n".join(problems)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector selects these labels (matchLabels, and matchExpressions In, NotIn,
    Exists, DoesNotExist)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        holds = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not holds:
            return False
    return True


def network_policies() -> list[dict[str, Any]]:
    return [document for _, document in kubernetes_objects() if document["kind"] == "NetworkPolicy"]


def rule_ports(rule: dict[str, Any], ports: dict[str, int]) -> set[int | str]:
    """The ports a policy rule lets through to a pod whose container ports are ports (name -> number): a name the
    pod does not declare opens nothing there; "any" when the rule names no port."""
    if not rule.get("ports"):
        return {"any"}
    opened: set[int | str] = set()
    for port in rule["ports"]:
        if "port" not in port:
            opened.add("any")
        elif isinstance(port["port"], int):
            opened.add(port["port"])
        elif port["port"] in ports:
            opened.add(ports[port["port"]])
    return opened


def test_network_policies_let_in_only_what_each_pod_serves():
    """Every pod is closed by default; the heartbeat port is open to the machines' networks alone, each other
    port a pod declares to a named source; the heartbeat servers and the migration reach BMDB and DNS alone."""
    policies = network_policies()
    assert policies, "no NetworkPolicy in deploy/kubernetes"
    problems = []
    for where, metadata, spec in pod_specs():
        labels = metadata.get("labels", {})
        ports = {
            port.get("name", str(port["containerPort"])): int(port["containerPort"])
            for container in spec["containers"]
            for port in container.get("ports", [])
        }
        selecting = [policy for policy in policies if selects(policy["spec"]["podSelector"], labels)]
        if not any("Ingress" in policy["spec"].get("policyTypes", []) for policy in selecting):
            problems.append(f"{where}: no NetworkPolicy closes it to ingress")
        let_in: dict[int | str, list[dict[str, Any]]] = {}
        for policy in selecting:
            for rule in policy["spec"].get("ingress", []):
                if not rule.get("from"):
                    problems.append(f"{where}: NetworkPolicy {policy['metadata']['name']} lets anyone in")
                for port in rule_ports(rule, ports):
                    let_in.setdefault(port, []).extend(rule.get("from", []))
        for port in set(let_in) - set(ports.values()):
            problems.append(f"{where}: a NetworkPolicy opens port {port}, which it does not serve")
        if "heartbeat" in ports:
            sources = let_in.get(ports["heartbeat"], [])
            if not sources or any(set(source) != {"ipBlock"} for source in sources):
                problems.append(f"{where}: the heartbeat port is open to {sources}, not to the machines' networks")
        if labels.get("app.kubernetes.io/component") in ("heartbeat-server", "migrate"):
            egress = [policy for policy in selecting if "Egress" in policy["spec"].get("policyTypes", [])]
            reachable = {
                port for policy in egress for rule in policy["spec"].get("egress", []) for port in rule_ports(rule, {})
            }
            if not egress or not reachable <= BMDB_ONLY_PORTS:
                problems.append(
                    f"{where}: may connect to ports {sorted(map(str, reachable))}, not BMDB's and DNS alone"
                )
        if labels.get("app.kubernetes.io/component") == "api":
            egress = [policy for policy in selecting if "Egress" in policy["spec"].get("policyTypes", [])]
            reachable = {
                port for policy in egress for rule in policy["spec"].get("egress", []) for port in rule_ports(rule, {})
            }
            if not egress or not reachable <= API_PORTS:
                problems.append(
                    f"{where}: may connect to ports {sorted(map(str, reachable))}, not Temporal's, BMDB's, the "
                    "issuer's and DNS alone"
                )
    assert not problems, "\n".join(problems)


def test_the_temporal_ui_is_read_only_for_operators():
    """Operators act through Shepherd's commands, which say who asked; the UI only shows."""
    found = []
    for path in yaml_files():
        for document in yaml_documents(path):
            for name, service in (document.get("services") or {}).items():
                if str(service.get("image", "")).split(":")[0] == TEMPORAL_UI_IMAGE:
                    found.append(name)
                    environment = service.get("environment", {})
                    assert str(environment.get("TEMPORAL_DISABLE_WRITE_ACTIONS")).lower() == "true", (
                        f"{rel(path)} service {name}: the Temporal UI lets operators signal, cancel and terminate"
                    )
    assert found, "no Temporal UI in deploy/"


def test_systemd_units_are_sandboxed(tmp_path):
    """Each unit carries the sandbox, and systemd-analyze security rates its exposure at most 2.0 of 10."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed (Debian: apt-get install systemd)")
    problems = []
    for unit in systemd_units():
        where = rel(unit.path)
        for key, value in SYSTEMD_SANDBOX.items():
            if unit.directives.get(key, [None])[-1] != value:
                problems.append(f"{where}: {key}={unit.directives.get(key, ['(unset)'])[-1]}, not {value!r}")
        filters = unit.directives.get("SystemCallFilter", [])
        if not filters or filters[0] != SYSTEM_SERVICE_FILTER:
            problems.append(f"{where}: SystemCallFilter= does not start from {SYSTEM_SERVICE_FILTER}")
        if unit.directives.get("DynamicUser") != ["yes"] and unit.directives.get("User", ["root"])[-1] in ("root", "0"):
            problems.append(f"{where}: runs as root")
        result = subprocess.run(
            [analyze, "security", "--offline=yes", f"--threshold={SYSTEMD_EXPOSURE_THRESHOLD}", str(unit.path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        overall = [line for line in result.stdout.splitlines() if "Overall exposure" in line]
        if result.returncode != 0:
            rating = overall[-1].strip("→ ") if overall else result.stderr.strip()
            problems.append(f"{where}: {rating}, above {SYSTEMD_EXPOSURE_THRESHOLD / 10:g}")
    assert not problems, "\n".join(problems)
