"""Extension points: third-party packages add model families (and, later, logits processors and API routes)
through Python entry points, without forking the engine.

A plugin is a callable registered in a package's metadata under the group `asyncengine.plugins`:

    [project.entry-points."asyncengine.plugins"]
    my_models = "my_package.asyncengine_plugin:register"

`register(registry: PluginRegistry) -> None` is called once, when the engine first loads plugins. It may call
`registry.register_model(architecture, model_class)`: `architecture` is the name a checkpoint's config.json lists
under "architectures"; `model_class(hf_config, dtype, max_positions)` must build an nn.Module with the interface of
`asyncengine.models.llama.LlamaForCausalLM` (forward over a flat batch with paged KV, compute_logits(hidden,
out=None) writing float32 logits into `out` when given, load_weights(weights, loaded=None); `loaded` is optional: a
family that takes it adds each written (parameter name, shard id) pair as it is written, so that its layers are
processed, e.g. quantized, as soon as each is complete). A plugin that raises is reported by name and skipped; it
never stops the engine from starting.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Callable

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asyncengine.plugins"


class PluginRegistry:
    """What a plugin may extend. Every method is safe to call more than once with the same arguments."""

    def register_model(self, architecture: str, model_class: type) -> None:
        from asyncengine.models import register_model

        register_model(architecture, model_class)


_loaded = False


def load_plugins(plugins: dict[str, Callable[[PluginRegistry], None]] | None = None) -> list[str]:
    """Call every installed plugin once (or the given name -> callable mapping); returns the names loaded."""
    global _loaded
    if plugins is None:
        if _loaded:
            return []
        _loaded = True
        plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    registry, loaded = PluginRegistry(), []
    for name, plugin in plugins.items():
        try:
            register = plugin.load() if hasattr(plugin, "load") else plugin
            register(registry)
            loaded.append(name)
        except Exception:  # a broken plugin must not take the engine down
            logger.exception("asyncengine plugin %r failed to load; skipped", name)
    return loaded
