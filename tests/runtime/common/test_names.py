"""The one adapter-name rule: the command line, the wire, the SDK and the offline engine all use it."""

from __future__ import annotations

import pytest

from runtime.common.names import MAX_ADAPTER_NAME, adapter_name_problem, check_adapter_name
from runtime.serve_args import ServeArgsError, parse_adapter


@pytest.mark.parametrize("name", ["a", "sql", "chat-v2.1_b", "A" * MAX_ADAPTER_NAME, "0"])
def test_good_names(name):
    assert adapter_name_problem(name) is None and check_adapter_name(name) == name
    assert parse_adapter(f"{name}=/p") == (name, "/p")


@pytest.mark.parametrize(
    "name", ["", "../../etc", "a/b", "a\nb", " a", "-a", ".a", "x" * (MAX_ADAPTER_NAME + 1), "é"]
)
def test_bad_names(name):
    problem = adapter_name_problem(name)
    assert problem is not None and len(problem) < 200
    with pytest.raises(ValueError, match="adapter name"):
        check_adapter_name(name)
    with pytest.raises(ServeArgsError):
        parse_adapter(f"{name}=/p")


def test_not_a_string():
    assert "string" in adapter_name_problem(3)
