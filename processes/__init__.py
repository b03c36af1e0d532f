"""The long-running processes Shepherd runs beside Temporal: the worker and the heartbeat server."""
