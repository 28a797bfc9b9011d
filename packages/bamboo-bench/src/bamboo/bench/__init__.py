"""bamboo.bench: Spot preemption traces, the trace-driven simulator (throughput, cost, value) and experiment reports for Bamboo."""

__all__: list[str] = []
