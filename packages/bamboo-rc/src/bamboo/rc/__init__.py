"""bamboo.rc: Bamboo runtime: a pipeline stage executor with redundant layers, eager FRC with CPU swap, exact replica sync, lazy BRC and failover."""

__all__: list[str] = []
