"""The takeover agent: Shepherd's side (takeover) and the reference agent run on machines."""
