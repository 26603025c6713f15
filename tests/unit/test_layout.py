"""The layout of session/: every module imports on its own (no import circle shows only in some
import order), and each sub-package says in its docstring what lives there and what it may import."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

import session
from tests.conftest import REPO

MODULES = sorted(m.name for m in pkgutil.walk_packages(session.__path__, "session."))
PACKAGES = sorted(m.name for m in pkgutil.walk_packages(session.__path__, "session.") if m.ispkg)

# In a child process: each module imported first, with no other module of session/ loaded.
FIRST_IMPORTS = """
import importlib, json, sys, traceback
failures = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "session" or m.startswith("session.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failures[name] = traceback.format_exc(limit=3)
print(json.dumps(failures))
"""


def test_each_module_imports_first():
    """A runtime import circle raises when one of its modules is imported first."""
    out = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, json.dumps(MODULES)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {}
    assert len(MODULES) > 50


def test_the_layers_are_the_packages_we_document():
    assert [p for p in PACKAGES if p.count(".") == 1] == [
        "session.engine", "session.families", "session.front", "session.model", "session.serving",
        "session.speculative", "session.state"]


@pytest.mark.parametrize("name", PACKAGES)
def test_each_package_says_what_it_may_import(name):
    doc = importlib.import_module(name).__doc__ or ""
    assert len(doc.split()) >= 30 and ("May import" in doc or "same rules apply" in doc), name


def test_the_packages_public_names_load_on_first_use_only():
    """``from session.engine import Engine`` works, and importing one engine module loads no other."""
    code = ("import sys; import session.engine.scheduler; lazy = 'session.engine.loop' not in sys.modules; "
            "from session.engine import Engine; from session.front import Front, FrontConfig; "
            "from session.speculative import SpeculativeDecoder; "
            "print(lazy, Engine.__module__, Front.__module__, FrontConfig.__module__, SpeculativeDecoder.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == ["True", "session.engine.loop", "session.front.server", "session.front.config",
                   "session.speculative.decoder"]
    with pytest.raises(AttributeError):
        importlib.import_module("session.engine").NoSuchThing  # noqa: B018
