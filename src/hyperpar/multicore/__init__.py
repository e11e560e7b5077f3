"""Collectively owned execution resources and the expert-parallel MoeExperts layer."""
