"""bamboo.launch: bamboo-launch: agents, workers, an embedded etcd, the emulated spot cluster and Kubernetes manifests for Bamboo."""

__all__: list[str] = []
