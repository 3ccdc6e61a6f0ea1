"""Analytic memory and time model of any layout on any cluster (``zerotron plan``).

Imports the config layer only, never torch: plans run anywhere in milliseconds.

- :mod:`~zerotron.plan.hardware`: device profiles (shipped and user files);
- :mod:`~zerotron.plan.model`: parameter counts and FLOPs;
- :mod:`~zerotron.plan.memory`: model states (ZeRO 0–3, offload), buffers;
  :mod:`~zerotron.plan.activations`: what backward saves, micro-batches in flight;
- :mod:`~zerotron.plan.timing`: compute, α–β collectives, overlap, bubble, offload;
  :mod:`~zerotron.plan.tensor_parallel`: tp collectives, exposed or overlapped as Transformer Engine does;
- :mod:`~zerotron.plan.layout`: the layout, its workload and every validity check;
- :mod:`~zerotron.plan.planner`: one layout's plan; :mod:`~zerotron.plan.search`: the best layouts;
- :mod:`~zerotron.plan.calibrate`: fit a profile to a run; :mod:`~zerotron.plan.report`: output.
"""

from __future__ import annotations

from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import PROFILES, Hardware, get_hardware
from zerotron.plan.layout import Layout, Workload
from zerotron.plan.planner import Plan, plan_config, plan_layout
from zerotron.shapes import ModelShape

__all__ = [
    "PROFILES",
    "Hardware",
    "Layout",
    "ModelShape",
    "Plan",
    "PlanError",
    "Workload",
    "get_hardware",
    "plan_config",
    "plan_layout",
]
