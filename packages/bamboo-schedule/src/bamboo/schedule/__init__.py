"""bamboo.schedule: Pipeline schedule IR: 1F1B/GPipe generators, redundant computation (FRC/BRC), failover merging, validator and cost-model simulator. Pure Python, no torch."""

__all__: list[str] = []
