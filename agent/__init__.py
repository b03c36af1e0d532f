"""What ships to a machine: the reference agent, its heartbeat loop, and the build that packs them."""
