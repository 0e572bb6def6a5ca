"""`python -m tensorfold` is the `tensorfold` command.

`-m` puts the working directory first on sys.path, so a folder there named `tensorfold` (a cache, a checkout's
data) is imported as the package in place of the installed one: with no `__init__.py` it becomes an empty namespace
package, every `from tensorfold import …` fails far from the cause, and with an editable install this very file is
still found. So before anything else is imported the package is checked to be the one this file lives in; when it
is not, the real one is loaded in its place and one line on stderr names the folder that shadowed it.
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _shadow() -> str | None:
    """The folder that `tensorfold` was imported from when it is not this file's package, else None."""
    package = sys.modules.get("tensorfold")
    where = getattr(package, "__file__", None)
    if where is not None and Path(where).resolve().parent == HERE:
        return None
    found = list(getattr(package, "__path__", None) or [])
    return found[0] if found else str(where)


def _load_real_package() -> None:
    """Import this file's package as `tensorfold`, replacing the shadow and anything imported from it."""
    for name in [n for n in sys.modules if n == "tensorfold" or n.startswith("tensorfold.")]:
        if name != "tensorfold.__main__":
            del sys.modules[name]
    spec = importlib.util.spec_from_file_location("tensorfold", HERE / "__init__.py",
                                                  submodule_search_locations=[str(HERE)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["tensorfold"] = package
    spec.loader.exec_module(package)


shadow = _shadow()
if shadow is not None:
    print(f"tensorfold: the folder {shadow} shadows the installed package for `python -m tensorfold` (the working "
          f"directory comes first on sys.path); using {HERE}. Rename the folder, or run the `tensorfold` command.",
          file=sys.stderr)
    _load_real_package()

from tensorfold.cli import main  # noqa: E402  (after the package is the real one)

main()
