"""bamboo.reconfig: Reconfiguration planning for Bamboo: when to reconfigure, the new layout and the layer-transfer plan. Pure functions."""

__all__: list[str] = []
