"""The emulated cluster's subcommands of ``bamboo-launch``, one module each.

- ``bamboo-launch run [...] [-- SCRIPT ARGS]``: train the built-in example, or a user script that calls
  ``bamboo.launch.train_worker``, on an emulated spot cluster (:mod:`bamboo.bench.emulated.cli.run`);
- ``bamboo-launch market``: the emulated spot market against one process per node
  (:mod:`bamboo.bench.emulated.cli.market`).

bamboo-launch's command line does not import them: each is declared in bamboo-bench's ``pyproject.toml`` under
the ``bamboo.launch.commands`` entry-point group, and :mod:`bamboo.launch.cli` loads what that group holds. Each
module has ``add_parser(subparsers)``, which registers its subcommand and its handler.
"""

__all__: list[str] = []
