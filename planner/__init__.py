"""Placement planner: measure the host, model the cost of a placement, choose one.

`plan(model_cfg, hardware, budget, workload, overrides) -> Plan` is pure; the runtime does
exactly what the returned `Plan` says.
"""
from planner.plan import Budget, KVPlan, Overrides, Plan, Placement, Prediction, Workload
from planner.profile import HardwareProfile, load_or_measure
from planner.search import plan
from planner.units import format_size, parse_size

__all__ = [
    "Budget", "HardwareProfile", "KVPlan", "Overrides", "Placement", "Plan", "Prediction",
    "Workload", "format_size", "load_or_measure", "parse_size", "plan",
]
