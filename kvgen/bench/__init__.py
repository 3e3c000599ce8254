"""Benchmarks: CUDA-graph timing against a device-to-device copy measured in the same run."""
