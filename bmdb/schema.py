"""The BMDB tables, as SQLAlchemy Core metadata (the migrations create them)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = MetaData()

# A machine Shepherd manages, whatever its provider.
machines = Table(
    "machines",
    metadata,
    Column("machine_id", UUID(as_uuid=True), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Where a machine comes from. A row is written before the provider is asked to
# create the machine (status "creating"), so BMDB always knows of every machine
# the provider may hold for us; the provider's answer turns it into "provided".
machine_provided = Table(
    "machine_provided",
    metadata,
    Column("machine_id", UUID(as_uuid=True), ForeignKey("machines.machine_id", ondelete="CASCADE"), primary_key=True),
    Column("provider", Text, nullable=False),
    Column("provider_id", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("address", Text),
    Column("ssh_port", Integer),
    Column("location", Text),
    # The SSH host key seen at first contact (OpenSSH format); a different key
    # later is refused until an operator resets this pin.
    Column("ssh_host_key", Text),
    # The SHA256 fingerprint an operator who reset the pin said the next key must have; NULL when any key may be
    # pinned. A key without it is refused and not pinned; pinning one clears this.
    Column("expected_host_key_fingerprint", Text),
    # Since when the provider no longer lists the machine; NULL while it does. Such a machine is reported and
    # left alone (no recovery), until the provider lists it again or an operator retires it.
    Column("missing_since", DateTime(timezone=True)),
    # Since when the machine is quarantined: recovered too often, it waits for an operator and is not watched.
    Column("quarantined_since", DateTime(timezone=True)),
    # Since when the machine's provisioning or agent start has outlasted its deadline; it keeps trying.
    Column("stuck_since", DateTime(timezone=True)),
    # Since when an operator keeps the machine out of automation (hardware work); the watchdog leaves it alone.
    Column("maintenance_since", DateTime(timezone=True)),
    # When the machine was decommissioned, and why: a retired machine is never adopted, started or watched again;
    # its rows stay for the history.
    Column("retired_at", DateTime(timezone=True)),
    Column("retired_reason", Text),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("provider", "provider_id", name="machine_provided_provider_key"),
)

machine_agent_started = Table(
    "machine_agent_started",
    metadata,
    Column("machine_id", UUID(as_uuid=True), ForeignKey("machines.machine_id", ondelete="CASCADE"), primary_key=True),
    Column("agent_started_at", DateTime(timezone=True), nullable=False),
    Column("agent_public_key", LargeBinary, nullable=False),
)

machine_agent_heartbeat = Table(
    "machine_agent_heartbeat",
    metadata,
    Column("machine_id", UUID(as_uuid=True), ForeignKey("machines.machine_id", ondelete="CASCADE"), primary_key=True),
    Column("agent_heartbeat_at", DateTime(timezone=True), nullable=False),
    # The agent's clock on the last accepted heartbeat; a request not newer is a replay.
    Column("agent_sent_at", DateTime(timezone=True)),
)

# Append-only log of every lifecycle step. Fleet-wide events (a refused
# reconcile pass) have no machine.
events = Table(
    "events",
    metadata,
    Column("event_id", BigInteger, primary_key=True, autoincrement=True),
    Column("machine_id", UUID(as_uuid=True), ForeignKey("machines.machine_id", ondelete="CASCADE")),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("kind", Text, nullable=False),
    Column("detail", Text, nullable=False, server_default=""),
    Index("events_machine_at", "machine_id", "at"),
)

# Every recovery reboot, keyed by the recovery cycle (the machine workflow's run) it belongs to, so a cycle
# that is retried after its reboot was done does not reboot again.
recovery_reboots = Table(
    "recovery_reboots",
    metadata,
    Column(
        "machine_id",
        UUID(as_uuid=True),
        ForeignKey("machines.machine_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("cycle", Text, primary_key=True),
    Column("rebooted_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("cause", Text, nullable=False),
)

# A recovery cycle's reboot asked of the provider and not yet recorded done (recovery_reboots): a retry that finds
# one looks for the reboot's evidence before asking again.
reboot_asks = Table(
    "reboot_asks",
    metadata,
    Column(
        "machine_id",
        UUID(as_uuid=True),
        ForeignKey("machines.machine_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("cycle", Text, primary_key=True),
    Column("asked_at", DateTime(timezone=True), nullable=False),
)

# The watchdog's last look at each provider instance's machines, and who made it (bmdb.watchdog's turns).
watchdog_looks = Table(
    "watchdog_looks",
    metadata,
    Column("provider", Text, primary_key=True),
    Column("looked_at", DateTime(timezone=True), nullable=False),
    Column("looked_by", Text, nullable=False),
)

# When the watchdog signalled a silent agent's machine: agent_started_at names the agent, so a new agent's silence
# is signalled afresh; confirmed_at, when the machine's workflow confirmed that silence as its recovery began.
silence_signals = Table(
    "silence_signals",
    metadata,
    Column("machine_id", UUID(as_uuid=True), ForeignKey("machines.machine_id", ondelete="CASCADE"), primary_key=True),
    Column("agent_started_at", DateTime(timezone=True), nullable=False),
    Column("signalled_at", DateTime(timezone=True), nullable=False),
    Column("confirmed_at", DateTime(timezone=True), nullable=True),
)

# The watchdog's circuit breaker: a provider's hold of recoveries (too many machines silent at once, or no
# heartbeat from any machine), with the operator's release; ended_at is set when the silence ends, and the
# machines silent since before then get a grace to come back.
recovery_holds = Table(
    "recovery_holds",
    metadata,
    Column("provider", Text, primary_key=True),
    Column("held_since", DateTime(timezone=True), nullable=False),
    Column("reason", Text, nullable=False),
    Column("silent_count", Integer, nullable=False),
    Column("threshold", Integer, nullable=False),
    Column("sample", Text, nullable=False, server_default=""),
    Column("released_at", DateTime(timezone=True)),
    Column("released_by", Text),
    Column("release_reason", Text),
    Column("ended_at", DateTime(timezone=True)),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Requests the operator API's policy gives to two people: each as asked, waiting for a second operator's
# decision until it expires; the decision and what came of it are kept.
operator_approvals = Table(
    "operator_approvals",
    metadata,
    Column("approval_id", UUID(as_uuid=True), primary_key=True),
    Column("action", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("request", JSONB, nullable=False),
    Column("asked_by", Text, nullable=False),
    Column("asked_via", Text, nullable=False),
    Column("asked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("decision", Text),
    Column("decided_by", Text),
    Column("decided_at", DateTime(timezone=True)),
    Column("outcome", Text),
    Index("operator_approvals_open", "expires_at", postgresql_where=text("decision IS NULL")),
)

PROVIDED_STATUS_CREATING = "creating"
PROVIDED_STATUS_PROVIDED = "provided"
