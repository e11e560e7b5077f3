"""Activation offload: trace a step, plan what to move to host, replay the plan."""
