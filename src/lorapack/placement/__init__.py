"""Placement: adapters onto the fewest GPUs, each with its ``--max-loras`` (placement.md §4-5).

``plan.py`` holds the plan types shared by the methods, verification, the exports and ``lorapack evaluate``.
"""

from .plan import BINDING, GpuMetrics, GpuPlan, Plan, plan_from_dict

__all__ = ["BINDING", "GpuMetrics", "GpuPlan", "Plan", "plan_from_dict"]
