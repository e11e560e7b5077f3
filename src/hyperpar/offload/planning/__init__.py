"""Planners: turn an ActivationTrace into a ResidencySchedule."""
