"""Multi-host tests: etcd and agents in Linux network namespaces on one bridge (see `netns`)."""
