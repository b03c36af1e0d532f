"""The protocol between Shepherd and the agents on its machines: protocol buffers and the heartbeat signature.

The ``*_pb2`` modules are generated from the ``.proto`` files beside them by
``python -m proto.generate``; a test checks that they match.
"""

# The longest an agent waits between two tries to reach the heartbeat server. After an outage on Shepherd's side
# every live agent is back within this and one heartbeat interval, which the watchdog waits for before it
# recovers the machines that fell silent during the outage.
AGENT_MAX_RETRY_INTERVAL = 300.0

# The trailing metadata of a heartbeat refused as stale: the server's clock, in Unix milliseconds, so an agent
# whose clock is off can send its heartbeats in the server's time.
SERVER_TIME_METADATA = "shepherd-server-time-ms"

# The trailing metadata of a Heartbeats stream refused because the server holds as many streams as it takes (from
# everywhere, or from the agent's address): the agent sends unary calls for a while instead, so a cap on streams
# costs a fleet its streams, never its heartbeats.
STREAM_REFUSED_METADATA = "shepherd-stream-refused"

# Run with this argument (and nothing on standard input), the agent executable stops the agent that runs on the
# machine, and answers a line that begins with AGENT_STOPPED on its standard output.
AGENT_STOP_ARGUMENT = "--stop"
AGENT_STOPPED = "stopped:"
