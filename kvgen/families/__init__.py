"""Kernel families: one spec class per template, with its variants and default meta-parameters."""
