"""Pure-torch references of kvgen's cache formats, written from docs/formats.md.

These know nothing about Triton or the kernels: they are the executable statement of each
format, and the tests compare every generated kernel against them byte for byte.
"""
