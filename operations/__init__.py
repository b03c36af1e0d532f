"""What operators do to the fleet: one client for the commands, and for an operator API to come."""
