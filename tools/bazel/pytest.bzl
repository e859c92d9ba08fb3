"""pytest_test: one py_test per test file, run by pytest (tools/bazel/pytest_main.py) with tests/conftest.py."""

def pytest_test(name, deps = [], data = [], size = "large", **kwargs):
    native.py_test(
        name = name,
        srcs = [name + ".py", "//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = ["$(location %s.py)" % name],
        deps = deps + [":conftest"],
        data = data + ["//:pyproject.toml"],
        python_version = "PY3",
        legacy_create_init = False,  # no __init__.py in tests/: pytest imports conftest as `conftest`
        size = size,
        **kwargs
    )
