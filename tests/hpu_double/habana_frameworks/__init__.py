"""Test double of Intel's habana_frameworks package (see tests/hpu_double/README.md)."""
