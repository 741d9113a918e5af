"""What the launch scripts run: the shared flags (cli) and the cluster launcher."""
