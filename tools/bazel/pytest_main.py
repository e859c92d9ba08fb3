"""Bazel's entry point for a test file: pytest on the file given as the argument (tools/bazel/pytest.bzl)."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
