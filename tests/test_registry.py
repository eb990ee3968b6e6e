"""The one registry every named plug-in kind uses (miles_core/plugins.py)."""

from __future__ import annotations

import sys

import pytest

from miles_core.plugins import Registry, import_object


def test_names_lazy_entries_import_paths_and_the_unknown_error():
    reg: Registry[object] = Registry("widget", "x.widget")
    reg.register("direct", dict)
    reg.register("lazy", "collections:OrderedDict")
    assert reg.names() == ["direct", "lazy"] and "lazy" in reg and "nope" not in reg
    assert reg.get("direct") is dict
    from collections import OrderedDict

    assert reg.get("lazy") is OrderedDict  # imported on first use
    assert reg.get("collections:Counter").__name__ == "Counter"  # an import path, not registered
    assert reg.names() == ["direct", "lazy"]  # looking up a path registers nothing
    with pytest.raises(
        ValueError,
        match=r"^unknown widget 'nope' in x\.widget; known: direct, lazy "
        r"\(or give an import path 'package\.module:object'\)$",
    ):
        reg.get("nope")
    with pytest.raises(ValueError, match="must be non-empty and without ':'"):
        reg.register("a:b", dict)
    reg.unregister("direct")
    assert reg.names() == ["lazy"]


def test_check_imports_nothing_for_a_registered_name_and_vets_an_import_path():
    reg: Registry[object] = Registry("widget", "x.widget")
    reg.register("later", "tests_registry_never_imported_module:Thing")
    assert reg.check("later") == "later"  # registered: not imported
    assert "tests_registry_never_imported_module" not in sys.modules
    assert reg.check("os.path:join") == "os.path:join"
    with pytest.raises(ValueError, match="cannot import widget 'no_such_mod:X': no module"):
        reg.check("no_such_mod:X")
    with pytest.raises(ValueError, match="cannot import widget 'os:nope': 'os' has no 'nope'"):
        reg.check("os:nope")
    with pytest.raises(ValueError, match="widget ':X': expected 'package.module:object'"):
        reg.check(":X")


def test_the_load_hook_turns_imports_into_entries_and_refuses_the_wrong_kind():
    def only_classes(obj, name):
        if not isinstance(obj, type):
            raise ValueError(f"widget {name!r} is not a class")
        return obj()

    reg: Registry[object] = Registry("widget", load=only_classes)
    reg.register("lazy", "collections:OrderedDict")
    assert reg.get("lazy") == {} and reg.get("lazy") is reg.get("lazy")  # built once, kept
    assert reg.get("collections:Counter") == {}
    with pytest.raises(ValueError, match="widget 'os.path:join' is not a class"):
        reg.get("os.path:join")
    assert reg.unknown("x").args[0] == (
        "unknown widget 'x'; known: lazy (or give an import path 'package.module:object')"
    )


def test_import_object_follows_dotted_attributes_and_raises_the_callers_error():
    class Custom(ValueError):
        pass

    assert import_object("os:path.join", "thing") is __import__("os").path.join
    with pytest.raises(Custom, match="thing 'nocolon': expected 'a.b:c'"):
        import_object("nocolon", "thing", example="a.b:c", error=Custom)
