"""Operating a fleet as traffic drifts: rates from observed traffic (``rates``); docs/replan.md."""
