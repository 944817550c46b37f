"""Measuring a model without its weights: shape and parameter counts (:mod:`.shape`) and the bytes one
training step keeps alive, traced on the meta device (:mod:`.trace`). :mod:`launcher.plan.planner` turns
these measurements into per-profile GPU and CPU peaks.
"""
