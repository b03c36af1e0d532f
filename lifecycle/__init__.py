"""The machine lifecycle's domain: the workflow contracts, the reconcile rule and the SSH takeover."""
