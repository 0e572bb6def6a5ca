"""Loading family plugins: entry-point group `tensorfold`, one entry per family, resolved once at startup."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import pluggy

from tensorfold import hookspecs
from tensorfold.family import Family, PluginError, check_static

GROUP = "tensorfold"
REQUIRED_HOOKS = tuple(name for name in dir(hookspecs)
                       if name.startswith("family_") and name not in hookspecs.OPTIONAL)


INSTALL_HINT = ("install a family's package from the TensorFold source tree (the packages are not on PyPI yet): "
                "pip install ./tensorfold_qwen, ./tensorfold_glm or ./plugins/tensorfold_example")


def installed_names() -> list[str]:
    """Names of the installed families (entry points in group `tensorfold`)."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=GROUP)})


def plugin_manager() -> pluggy.PluginManager:
    """A fresh manager that knows the hook specs and holds no plugin yet."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def load_families(names: Iterable[str] | None = None) -> dict[str, Family]:
    """Load the named families from their entry points (all installed ones when `names` is None)."""
    wanted = installed_names() if names is None else list(names)
    pm = plugin_manager()
    for name in wanted:
        if pm.load_setuptools_entrypoints(GROUP, name=name) == 0 and pm.get_plugin(name) is None:
            known = ", ".join(installed_names()) or "none"
            raise PluginError(f"no family named {name!r} is installed (installed: {known}); {INSTALL_HINT}")
    return resolve(pm, wanted)


def register_families(plugins: dict[str, ModuleType | object]) -> dict[str, Family]:
    """Register plugin objects under family names without entry points (tests and embedding)."""
    pm = plugin_manager()
    for name, plugin in plugins.items():
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as err:
            raise PluginError(f"family {name!r} (plugin {_module_of(plugin)}): {err}") from err
    return resolve(pm, list(plugins))


def resolve(pm: pluggy.PluginManager, names: list[str]) -> dict[str, Family]:
    """Check every registered family's hooks and bind each hook to its own plugin."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise PluginError(f"a family implements a hook that does not exist: {err}") from err
    families = {}
    for name in names:
        plugin = pm.get_plugin(name)
        families[name] = _bind(pm, name, plugin)
    _check_model_types(families)
    return families


def _bind(pm: pluggy.PluginManager, name: str, plugin: object) -> Family:
    module = _module_of(plugin)
    implemented = {hook.name for hook in pm.get_hookcallers(plugin) or []}
    missing = [hook for hook in REQUIRED_HOOKS if hook not in implemented]
    if missing:
        raise PluginError(f"family {name!r} (plugin {module}) does not implement {', '.join(missing)}")
    others = [p for p in pm.get_plugins() if p is not plugin]

    def call(hook: str, **kwargs: Any) -> Any:
        caller = pm.subset_hook_caller(hook, remove_plugins=others)
        try:
            return caller(**kwargs)
        except PluginError:
            raise
        except Exception as err:
            raise PluginError(f"family {name!r} (plugin {module}): {hook} raised "
                              f"{type(err).__name__}: {err}") from err

    model_types = call("family_model_types")
    switch = call("family_request_starts_switch")
    check_static(name, module, model_types, switch)
    return Family(name=name, module=module, model_types=tuple(model_types), request_starts_switch=switch, call=call)


def _check_model_types(families: dict[str, Family]) -> None:
    owner: dict[str, str] = {}
    for family in families.values():
        for model_type in family.model_types:
            if model_type in owner:
                raise PluginError(f"model type {model_type!r} is claimed by family {owner[model_type]!r} and by "
                                  f"family {family.name!r} (plugin {family.module})")
            owner[model_type] = family.name


def _module_of(plugin: object) -> str:
    return plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__


def family_for(families: dict[str, Family], model_type: str) -> Family:
    """The family that serves a checkpoint's model type."""
    for family in families.values():
        if model_type in family.model_types:
            return family
    served = {t: f.name for f in families.values() for t in f.model_types}
    raise PluginError(f"no loaded family serves model_type {model_type!r} (served: {served or 'none'})")
