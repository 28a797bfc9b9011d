"""bamboo.membership: Bamboo cluster membership and failure detection: etcd leases and watches, a gRPC agent service, an etcd-backed c10d store."""

__all__: list[str] = []
