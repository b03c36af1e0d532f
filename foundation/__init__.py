"""What every process stands on: settings, logs, metrics, TLS, the SSH identity and connecting at start."""
