"""``lorapack evaluate``: derive workloads from a trace, place them with every method, replay the plans
through the twin (placement.md §6)."""
